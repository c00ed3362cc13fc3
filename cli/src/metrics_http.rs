//! `mwcap serve --metrics ADDR`: the library's telemetry
//! (`mwcap::telemetry`) in the Prometheus text format, over plain HTTP.
//! Each scrape records the endpoints' figures first
//! (`Endpoint::record_metrics`), so they are as of the scrape, then
//! renders what the `metrics-exporter-prometheus` recorder holds. The
//! command answers the HTTP itself (one request per connection, `GET
//! /metrics` or `GET /`), so no HTTP server or async runtime comes with it.

use std::io::{self, Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::time::Duration;

use metrics_exporter_prometheus::{Matcher, PrometheusBuilder, PrometheusHandle};

/// Bucket bounds of the capability age histogram, in seconds: from 10 µs
/// (a READ on the same host) to a minute (a lease timer's order).
const AGE_BUCKETS: [f64; 14] = [1e-5, 1e-4, 5e-4, 1e-3, 5e-3, 0.01, 0.05, 0.1, 0.5, 1.0, 5.0, 10.0, 30.0, 60.0];

/// Install the Prometheus recorder as the process's `metrics` recorder.
pub fn install() -> Result<PrometheusHandle, String> {
    PrometheusBuilder::new()
        .set_buckets_for_metric(Matcher::Full("mwcap_capability_age_seconds".into()), &AGE_BUCKETS)
        .and_then(PrometheusBuilder::install_recorder)
        .map_err(|e| format!("cannot install the Prometheus recorder: {e}"))
}

/// Bind `addr` for the scrapes.
pub fn bind(addr: SocketAddr) -> Result<TcpListener, String> {
    TcpListener::bind(addr).map_err(|e| format!("cannot serve metrics on {addr}: {e}; pick another --metrics"))
}

/// Answer scrapes on `listener` until it fails: `record` records the
/// figures, then `handle` renders them.
pub fn serve(listener: TcpListener, handle: PrometheusHandle, record: impl Fn()) {
    for stream in listener.incoming() {
        let Ok(stream) = stream else { continue };
        if let Err(e) = answer(stream, &handle, &record) {
            tracing::debug!(%e, "a metrics scrape");
        }
    }
}

fn answer(mut stream: TcpStream, handle: &PrometheusHandle, record: &impl Fn()) -> io::Result<()> {
    stream.set_read_timeout(Some(Duration::from_secs(5)))?;
    stream.set_write_timeout(Some(Duration::from_secs(5)))?;
    // The request line and headers: at most 8 KiB, up to the empty line.
    let mut req = Vec::with_capacity(1024);
    let mut chunk = [0u8; 1024];
    while !req.windows(4).any(|w| w == b"\r\n\r\n") {
        let n = stream.read(&mut chunk)?;
        if n == 0 || req.len() + n > 8192 {
            break;
        }
        req.extend_from_slice(&chunk[..n]);
    }
    let line = req.split(|&b| b == b'\r').next().unwrap_or_default();
    let mut words = line.split(|&b| b == b' ');
    let (method, path) = (words.next().unwrap_or_default(), words.next().unwrap_or_default());
    let (status, body) = match (method, path) {
        (b"GET", b"/metrics" | b"/") => {
            record();
            handle.run_upkeep();
            ("200 OK", handle.render())
        }
        (b"GET", _) => ("404 Not Found", "mwcap serves its metrics at /metrics\n".to_owned()),
        _ => ("405 Method Not Allowed", "only GET\n".to_owned()),
    };
    write!(
        stream,
        "HTTP/1.1 {status}\r\nContent-Type: text/plain; version=0.0.4; charset=utf-8\r\nContent-Length: {}\r\n\
         Connection: close\r\n\r\n{body}",
        body.len()
    )?;
    stream.flush()
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicU64, Ordering};
    use std::sync::Arc;

    fn get(addr: SocketAddr, path: &str) -> String {
        let mut s = TcpStream::connect(addr).unwrap();
        write!(s, "GET {path} HTTP/1.1\r\nHost: x\r\n\r\n").unwrap();
        let mut out = String::new();
        s.read_to_string(&mut out).unwrap();
        out
    }

    /// Each scrape records first: the counter a scrape shows is the one
    /// its own `record` set.
    #[test]
    fn a_scrape_records_then_renders_in_the_prometheus_format() {
        let recorder = Arc::new(
            PrometheusBuilder::new()
                .set_buckets_for_metric(Matcher::Full("mwcap_capability_age_seconds".into()), &AGE_BUCKETS)
                .unwrap()
                .build_recorder(),
        );
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
                    metrics::histogram!("mwcap_capability_age_seconds", "endpoint" => "mw").record(0.002);
                });
            })
        });
        let first = get(addr, "/metrics");
        assert!(first.starts_with("HTTP/1.1 200 OK\r\n"), "{first}");
        assert!(first.contains("mwcap_binds_total{endpoint=\"mw\"} 10\n"), "{first}");
        assert!(first.contains("mwcap_capability_age_seconds_bucket{endpoint=\"mw\",le=\"0.005\"} 1\n"), "{first}");
        let second = get(addr, "/");
        assert!(second.contains("mwcap_binds_total{endpoint=\"mw\"} 20\n"), "{second}");
        let missing = get(addr, "/other");
        assert!(missing.starts_with("HTTP/1.1 404"), "{missing}");
        assert_eq!(scrapes.load(Ordering::SeqCst), 2, "a 404 records nothing");
    }
}
