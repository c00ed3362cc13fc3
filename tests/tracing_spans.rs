//! Per-call spans and trace ids, seen through a tracing subscriber. In a
//! test binary of its own: tracing caches whether a callsite is enabled
//! process-wide, so a thread-local subscriber set while other tests run
//! (with none) may see nothing.

use std::time::Duration;

use mwcap::conn::{Buf, Config, Event, Policies, Policy, SimPair};

fn pair(p: Policies) -> SimPair {
    SimPair::spec(7, p, Config::default(), Config::default()).expect("pair")
}

fn filled(p: &mut SimPair, bytes: &[u8]) -> Buf {
    let mut b = p.client.alloc().expect("free buffer");
    b.copy_from(bytes).unwrap();
    b
}

/// A writer into a shared buffer, for a captured tracing subscriber.
#[derive(Clone, Default)]
struct Captured(std::sync::Arc<std::sync::Mutex<Vec<u8>>>);

impl std::io::Write for Captured {
    fn write(&mut self, b: &[u8]) -> std::io::Result<usize> {
        self.0.lock().unwrap().extend_from_slice(b);
        Ok(b.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

#[test]
fn a_callers_trace_id_reaches_the_server_and_both_spans_record_it() {
    use mwcap::conn::TraceId;
    let trace = TraceId::from_hex("4bf92f3577b34da6a3ce929d0e0e4736").unwrap();
    assert_eq!(trace.to_string(), "4bf92f3577b34da6a3ce929d0e0e4736");
    let out = Captured::default();
    let sink = out.clone();
    let subscriber = tracing_subscriber::fmt()
        .with_max_level(tracing::Level::DEBUG)
        .with_ansi(false)
        .with_writer(move || sink.clone())
        .finish();
    tracing::subscriber::with_default(subscriber, || {
        let mut p = pair(Policies::both(Policy::Mw));
        let b = filled(&mut p, b"payload");
        let now = p.now();
        let call = p.client.call_traced(now, Some(trace), b"get", Some(b)).unwrap();
        assert!(p.drive_until(Duration::from_secs(1), |p| !p.server_events.is_empty()));
        let Some(Event::Request { req, data, trace: got, .. }) = p.server_events.pop() else {
            panic!("no request")
        };
        assert_eq!(got, Some(trace), "the server sees the caller's trace id");
        p.server.free(data.unwrap());
        let now = p.now();
        p.server.reply(now, req, 0, b"ok", None).unwrap();
        assert!(p.drive_until(Duration::from_secs(1), |p| p
            .client_events
            .iter()
            .any(|e| matches!(e, Event::Reply { call: c, .. } if *c == call))));
        // An untraced call carries none.
        let now = p.now();
        p.client.call(now, b"plain", None).unwrap();
        assert!(p.drive_until(Duration::from_secs(1), |p| !p.server_events.is_empty()));
        assert!(matches!(p.server_events.pop(), Some(Event::Request { trace: None, .. })));
    });
    let log = String::from_utf8(out.0.lock().unwrap().clone()).unwrap();
    let hex = "4bf92f3577b34da6a3ce929d0e0e4736";
    let line = |what: &str| {
        log.lines().find(|l| l.contains(what)).unwrap_or_else(|| panic!("no {what:?} in:\n{log}"))
    };
    // Each event sits in the connection's span and the call's or request's.
    let sent = line("call sent");
    assert!(
        sent.contains("mwcap.conn{") && sent.contains(&format!("mwcap.call{{call=1 trace={hex}}}")),
        "{sent}"
    );
    let received = line("request received");
    assert!(received.contains(&format!("mwcap.request{{req=1 trace={hex}}}")), "{received}");
    assert!(line("reply sent").contains(&format!("trace={hex}")));
    assert!(line("reply delivered").contains(&format!("mwcap.call{{call=1 trace={hex}}}")));
}
