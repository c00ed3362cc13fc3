//! `mwcap serve --metrics ADDR`: the library's telemetry
//! (`mwcap::telemetry`) in the Prometheus text format, over plain HTTP.
//! Each scrape records the endpoints' figures first
//! (`Endpoint::record_metrics`), so they are as of the scrape, then
//! renders what the `metrics-exporter-prometheus` recorder holds. The
//! command answers the HTTP itself (one request per connection, `GET
//! /metrics` or `GET /`), so no HTTP server or async runtime comes with it.

use std::io::{self, Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::time::{Duration, Instant};

use metrics_exporter_prometheus::{PrometheusBuilder, PrometheusHandle};

/// How long a scraper has to send its request, all of it.
const REQUEST_TIME: Duration = Duration::from_secs(2);
/// A scrape within this long of the last one gets the same page: scrapes
/// cost the data path nothing, but each takes every connection's lock
/// once, and anyone who reaches the port may scrape.
const FRESH: Duration = Duration::from_secs(1);

/// Install the Prometheus recorder as the process's `metrics` recorder.
pub fn install() -> Result<PrometheusHandle, String> {
    PrometheusBuilder::new()
        .install_recorder()
        .map_err(|e| format!("cannot install the Prometheus recorder: {e}"))
}

/// Bind `addr` for the scrapes.
pub fn bind(addr: SocketAddr) -> Result<TcpListener, String> {
    TcpListener::bind(addr)
        .map_err(|e| format!("cannot serve metrics on {addr}: {e}; pick another --metrics"))
}

/// Answer scrapes on `listener`, one at a time, for ever: `record` records
/// the figures, then `handle` renders them.
pub fn serve(listener: TcpListener, handle: PrometheusHandle, record: impl Fn()) {
    let mut page: Option<(Instant, String)> = None;
    for stream in listener.incoming() {
        match stream {
            Ok(stream) => {
                if let Err(e) = answer(stream, &mut page, &|| {
                    record();
                    handle.run_upkeep();
                    handle.render()
                }) {
                    tracing::debug!(%e, "a metrics scrape");
                }
            }
            // Out of file descriptors, say: wait rather than spin.
            Err(e) => {
                tracing::warn!(%e, "accepting a metrics scrape");
                std::thread::sleep(Duration::from_millis(100));
            }
        }
    }
}

/// Read one request within [`REQUEST_TIME`] and answer it.
fn answer(
    mut stream: TcpStream,
    page: &mut Option<(Instant, String)>,
    render: &dyn Fn() -> String,
) -> io::Result<()> {
    let deadline = Instant::now() + REQUEST_TIME;
    stream.set_write_timeout(Some(REQUEST_TIME))?;
    // The request line and headers: at most 8 KiB, up to the empty line.
    let mut req = Vec::with_capacity(1024);
    let mut chunk = [0u8; 1024];
    while !(req.windows(4).any(|w| w == b"\r\n\r\n") || req.windows(2).any(|w| w == b"\n\n")) {
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() || req.len() >= 8192 {
            break;
        }
        stream.set_read_timeout(Some(left))?;
        let n = stream.read(&mut chunk)?;
        if n == 0 {
            break;
        }
        req.extend_from_slice(&chunk[..n]);
    }
    let line = req.split(|&b| b == b'\n').next().unwrap_or_default();
    let line = line.strip_suffix(b"\r").unwrap_or(line);
    let mut words = line.split(|&b| b == b' ');
    let method = words.next().unwrap_or_default();
    let target = words.next().unwrap_or_default();
    let path = target.split(|&b| b == b'?').next().unwrap_or_default();
    let (status, extra, body) = match (method, path) {
        (b"GET", b"/metrics" | b"/") => {
            let fresh = page.as_ref().is_some_and(|(at, _)| at.elapsed() < FRESH);
            if !fresh {
                *page = Some((Instant::now(), render()));
            }
            ("200 OK", "", page.as_ref().map_or("", |(_, p)| p.as_str()))
        }
        (b"GET", _) => ("404 Not Found", "", "mwcap serves its metrics at /metrics\n"),
        _ => ("405 Method Not Allowed", "Allow: GET\r\n", "only GET\n"),
    };
    let mut out = Vec::with_capacity(body.len() + 160);
    write!(
        out,
        "HTTP/1.1 {status}\r\nContent-Type: text/plain; version=0.0.4; charset=utf-8\r\nContent-Length: {}\r\n\
         {extra}Connection: close\r\n\r\n",
        body.len()
    )?;
    out.extend_from_slice(body.as_bytes());
    stream.write_all(&out)?;
    stream.flush()
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicU64, Ordering};
    use std::sync::Arc;

    fn get(addr: SocketAddr, request: &str) -> String {
        let mut s = TcpStream::connect(addr).unwrap();
        s.write_all(request.as_bytes()).unwrap();
        let mut out = String::new();
        s.read_to_string(&mut out).unwrap();
        out
    }

    /// A scrape records first (the counter it shows is the one its own
    /// record set), a second scrape within a second gets the same page,
    /// and a query string, bare newlines, other paths and methods are
    /// answered as they should be.
    #[test]
    fn a_scrape_records_then_renders_in_the_prometheus_format() {
        let recorder = Arc::new(PrometheusBuilder::new().build_recorder());
        let handle = recorder.handle();
        let listener = bind("127.0.0.1:0".parse().unwrap()).unwrap();
        let addr = listener.local_addr().unwrap();
        let scrapes = Arc::new(AtomicU64::new(0));
        let (r, n) = (recorder.clone(), scrapes.clone());
        std::thread::spawn(move || {
            serve(listener, handle, move || {
                let k = n.fetch_add(1, Ordering::SeqCst) + 1;
                metrics::with_local_recorder(&*r, || {
                    metrics::counter!("mwcap_binds_total", "endpoint" => "mw").absolute(10 * k);
                });
            })
        });
        // A silent client does not hold the scrapes up for longer than
        // REQUEST_TIME.
        let _silent = TcpStream::connect(addr).unwrap();
        let first = get(addr, "GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n");
        assert!(first.starts_with("HTTP/1.1 200 OK\r\n"), "{first}");
        assert!(first.contains("mwcap_binds_total{endpoint=\"mw\"} 10\n"), "{first}");
        let again = get(addr, "GET /metrics?x=1 HTTP/1.0\n\n");
        assert!(again.contains("mwcap_binds_total{endpoint=\"mw\"} 10\n"), "within a second: {again}");
        assert_eq!(scrapes.load(Ordering::SeqCst), 1, "one record for both");
        std::thread::sleep(FRESH);
        let later = get(addr, "GET / HTTP/1.1\r\n\r\n");
        assert!(later.contains("mwcap_binds_total{endpoint=\"mw\"} 20\n"), "{later}");
        let missing = get(addr, "GET /other HTTP/1.1\r\n\r\n");
        assert!(missing.starts_with("HTTP/1.1 404"), "{missing}");
        let post = get(addr, "POST /metrics HTTP/1.1\r\n\r\n");
        assert!(post.starts_with("HTTP/1.1 405") && post.contains("Allow: GET\r\n"), "{post}");
        assert_eq!(scrapes.load(Ordering::SeqCst), 2, "only GETs of the page record");
    }
}
