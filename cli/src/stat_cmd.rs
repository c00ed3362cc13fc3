//! `mwcap stat`: a live view of a running `mwcap serve` (or any program
//! that serves `mwcap::stat`): its connections, their state and counters,
//! read from its local stat socket.

use std::collections::HashMap;
use std::fmt::Write as _;
use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;

use clap::Args;

/// Options of `mwcap stat`.
#[derive(Args)]
pub struct StatOpts {
    /// The server's stat socket (`mwcap serve` prints it; by default
    /// `/tmp/mwcap-<mw port>.sock`).
    #[arg(long, default_value_os_t = default_socket(18600))]
    pub socket: PathBuf,
    /// Print the server's lines as they come (`key=value` words, for scripts).
    #[arg(long)]
    pub raw: bool,
    /// Print a fresh view every SECS seconds until interrupted.
    #[arg(long, value_name = "SECS", value_parser = parse_secs)]
    pub watch: Option<Duration>,
}

/// A positive, finite number of seconds.
fn parse_secs(s: &str) -> Result<Duration, String> {
    let secs: f64 = s.parse().map_err(|e| format!("{s:?} is not a number of seconds ({e})"))?;
    match Duration::try_from_secs_f64(secs) {
        Ok(d) if !d.is_zero() => Ok(d),
        _ => Err(format!("{s} seconds: give a positive number of seconds, such as 2 or 0.5")),
    }
}

/// The stat socket of a server listening on `port`.
pub fn default_socket(port: u16) -> PathBuf {
    PathBuf::from(format!("/tmp/mwcap-{port}.sock"))
}

pub fn run(o: &StatOpts) -> ExitCode {
    loop {
        let text = match mwcap::stat::fetch(&o.socket) {
            Ok(t) => t,
            Err(e) => {
                eprintln!("mwcap stat: {e}");
                return ExitCode::FAILURE;
            }
        };
        if o.raw {
            print!("{text}");
        } else {
            match table(&text) {
                Ok(t) => print!("{t}"),
                Err(e) => {
                    eprintln!("mwcap stat: {}: {e}", o.socket.display());
                    return ExitCode::FAILURE;
                }
            }
        }
        match o.watch {
            Some(every) => {
                std::thread::sleep(every);
                println!();
            }
            _ => return ExitCode::SUCCESS,
        }
    }
}

/// A line's `key=value` words; a `reason=` word takes the rest of the line.
fn fields(line: &str) -> HashMap<&str, &str> {
    let (head, reason) = match line.find(" reason=") {
        Some(i) => (&line[..i], Some(&line[i + " reason=".len()..])),
        None => (line, None),
    };
    let mut m: HashMap<&str, &str> = head.split(' ').filter_map(|w| w.split_once('=')).collect();
    if let Some(r) = reason {
        m.insert("reason", r);
    }
    m
}

/// A device line: its name, then its nonzero counters (zeros are noise).
fn device(rest: &str) -> String {
    let f = fields(rest);
    let mut out = format!(
        "device {} port {}:",
        f.get("name").copied().unwrap_or("?"),
        f.get("port").copied().unwrap_or("?")
    );
    if let Some(r) = f.get("reason") {
        return format!("{out} {r}\n");
    }
    let mut words: Vec<(&str, &str)> = f
        .iter()
        .filter(|(k, v)| !matches!(**k, "name" | "port") && **v != "0")
        .map(|(k, v)| (*k, *v))
        .collect();
    words.sort();
    if words.is_empty() {
        out.push_str(" every counter 0");
    }
    for (i, (k, v)) in words.iter().enumerate() {
        out.push_str(if i % 6 == 0 { "\n  " } else { "  " });
        out.push_str(&format!("{k}={v}"));
    }
    out.push('\n');
    out
}

fn bytes(n: u64) -> String {
    match n {
        n if n >= 1 << 30 => format!("{:.1}G", n as f64 / (1u64 << 30) as f64),
        n if n >= 1 << 20 => format!("{:.1}M", n as f64 / (1u64 << 20) as f64),
        n if n >= 1 << 10 => format!("{:.1}K", n as f64 / 1024.0),
        n => format!("{n}"),
    }
}

fn age(ms: u64) -> String {
    match ms / 1000 {
        s if s >= 3600 => format!("{}h{:02}m", s / 3600, s % 3600 / 60),
        s if s >= 60 => format!("{}m{:02}s", s / 60, s % 60),
        s => format!("{s}.{}s", ms % 1000 / 100),
    }
}

/// The server's text as a table, one row per connection and a total.
pub fn table(text: &str) -> Result<String, String> {
    let mut lines = text.lines();
    let head = lines.next().ok_or("the server sent nothing")?;
    let h = fields(head);
    if !head.starts_with("mwcap-stat ") {
        return Err(format!("not a mwcap stat socket (it said {head:?})"));
    }
    let version = head.split(' ').nth(1).unwrap_or("?");
    if version != mwcap::stat::FORMAT_VERSION.to_string() {
        return Err(format!(
            "format version {version}; this mwcap reads version {}: use the server's mwcap, or --raw",
            mwcap::stat::FORMAT_VERSION
        ));
    }
    let mut out = String::new();
    let mut rows = Vec::new();
    let mut reasons = Vec::new();
    let mut total = None;
    let mut devices = Vec::new();
    for line in lines {
        if let Some(rest) = line.strip_prefix("device ") {
            devices.push(device(rest));
            continue;
        }
        if let Some(rest) = line.strip_prefix("hub ") {
            let f = fields(rest);
            let g = |k: &str| f.get(k).copied().unwrap_or("?");
            let mut hub = format!(
                "hub {}: {} connection(s), {} of {} queue entries reserved, {} completions ({} orphans), {} turns, {} connection turns, {} sleeps",
                g("name"),
                g("connections"),
                g("reserved_entries"),
                g("depth"),
                g("completions"),
                g("orphans"),
                g("turns"),
                g("connection_turns"),
                g("sleeps")
            );
            if f.contains_key("srq_slots") {
                let _ = write!(
                    hub,
                    "; shared receives: {} of {} held by shares ({} bytes), {} frames, {} grown, {} withheld, {} given back, {} limit events, {} refused, {} unclaimed",
                    g("srq_shares"),
                    g("srq_slots"),
                    g("srq_bytes"),
                    g("srq_frames"),
                    g("srq_grown"),
                    g("srq_withheld"),
                    g("srq_given_back"),
                    g("srq_limit_events"),
                    g("srq_refused"),
                    g("srq_unclaimed")
                );
            }
            if f.contains_key("srq_send_slots") {
                let _ = write!(hub, ", {} send slots ({} lent)", g("srq_send_slots"), g("srq_send_lent"));
            }
            if f.contains_key("srq_chunks_retired") {
                let _ = write!(
                    hub,
                    ", {} chunks retired ({} freed)",
                    g("srq_chunks_retired"),
                    g("srq_chunks_freed")
                );
            }
            if f.contains_key("pool_buffers") {
                let _ = write!(
                    hub,
                    "; shared buffers: {} of {} free ({} bytes, {} held), {} taken, {} waits for an empty class, {} wake-ups",
                    g("pool_free"),
                    g("pool_buffers"),
                    g("pool_bytes"),
                    g("pool_held_bytes"),
                    g("pool_taken"),
                    g("pool_empty"),
                    g("pool_wakeups")
                );
            }
            if f.contains_key("pool_windows") {
                let _ = write!(
                    hub,
                    "; shared windows: {} of {} free, {} lent, {} allocated, {} dropped with their connection, {} allocations failed, {} waits for a window",
                    g("pool_windows_free"),
                    g("pool_windows"),
                    g("pool_windows_lent"),
                    g("pool_windows_allocated"),
                    g("pool_windows_dropped"),
                    g("pool_window_alloc_failures"),
                    g("pool_window_waits")
                );
            }
            hub.push('\n');
            devices.push(hub);
            continue;
        }
        let f = fields(line);
        let n = |k: &str| f.get(k).and_then(|v| v.parse::<u64>().ok()).unwrap_or(0);
        let row = |id: String, peer: &str, qpn: &str, role: &str, pol: String, state: &str, age: String| {
            vec![
                id,
                peer.to_string(),
                qpn.to_string(),
                role.to_string(),
                pol,
                state.to_string(),
                age,
                n("calls").saturating_add(n("requests")).to_string(),
                n("calls_failed")
                    .saturating_add(n("requests_dropped"))
                    .saturating_add(n("requests_busy"))
                    .to_string(),
                bytes(n("bytes_read")),
                bytes(n("bytes_exposed")),
                n("binds").to_string(),
                n("invalidations").to_string(),
                n("expiries").to_string(),
                n("stale_reads").to_string(),
                format!("{}/{}", n("credits"), n("credit_waits")),
                format!(
                    "{}/{}/{}/{}",
                    n("buffers_free"),
                    n("buffers_user"),
                    n("buffers_exposed"),
                    n("buffers_reading")
                ),
            ]
        };
        if line.starts_with("conn ") {
            let g = |k: &str| f.get(k).copied().unwrap_or("?");
            let id = g("id").to_string();
            if let Some(r) = f.get("reason") {
                reasons.push(format!("  {id}: {r}"));
            }
            let pol = format!("{}/{}", g("request"), g("reply"));
            rows.push(row(id, g("peer"), g("qpn"), g("role"), pol, g("state"), age(n("age_ms"))));
        } else if line.starts_with("total ") {
            let state = format!("{} up", n("up"));
            total = Some(row("total".into(), "", "", "", String::new(), &state, String::new()));
        }
    }
    let _ = std::fmt::Write::write_fmt(
        &mut out,
        format_args!(
            "pid {}: {} connection(s)\n",
            h.get("pid").copied().unwrap_or("?"),
            h.get("connections").copied().unwrap_or("?")
        ),
    );
    let header: Vec<String> = [
        "ID",
        "PEER",
        "QPN",
        "ROLE",
        "REQ/REP",
        "STATE",
        "AGE",
        "OPS",
        "FAILED",
        "READ",
        "EXPOSED",
        "BINDS",
        "INVAL",
        "EXPIRED",
        "STALE",
        "CREDIT/WAITS",
        "BUFS F/U/E/R",
    ]
    .iter()
    .map(|s| s.to_string())
    .collect();
    let all: Vec<&Vec<String>> = std::iter::once(&header).chain(rows.iter()).chain(total.iter()).collect();
    let widths: Vec<usize> =
        (0..header.len()).map(|i| all.iter().map(|r| r[i].len()).max().unwrap_or(0)).collect();
    for r in all {
        let cells: Vec<String> = r.iter().zip(&widths).map(|(c, w)| format!("{c:<w$}")).collect();
        out.push_str(cells.join("  ").trim_end());
        out.push('\n');
    }
    for d in devices {
        out.push_str(&d);
    }
    if !reasons.is_empty() {
        out.push_str("down:\n");
        for r in reasons {
            out.push_str(&r);
            out.push('\n');
        }
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_snapshot_becomes_a_table_with_a_row_per_connection_and_the_reasons() {
        let text = "mwcap-stat 1 pid=7 connections=2\n\
            conn id=3 peer=10.0.0.7:4000 qpn=17 role=server request=mw reply=mw state=up age_ms=61500 \
            calls=0 requests=12 bytes_read=2048 binds=12 invalidations=12 credits=60 credit_waits=1 buffers_free=30\n\
            conn id=4 peer=- qpn=18 role=server request=confirm reply=confirm state=down age_ms=10 \
            requests=1 reason=the peer closed the connection\n\
            total connections=2 up=1 requests=13 bytes_read=2048\n\
            hub name=mw connections=2 added=5 reserved_entries=110 depth=32767 completions=900 orphans=0 turns=40 connection_turns=70 sleeps=9\n\
            device name=rxe0 port=1 rcvd_rnr_err=3 send_rnr_err=0 sent_pkts=120\n";
        let t = table(text).unwrap();
        assert!(t.starts_with("pid 7: 2 connection(s)\n"), "{t}");
        let rows: Vec<&str> = t.lines().collect();
        assert!(rows[1].starts_with("ID"));
        assert!(rows[2].starts_with("3 ") && rows[2].contains("10.0.0.7:4000") && rows[2].contains("1m01s"));
        assert!(rows[2].contains(" 12 ") && rows[2].contains("2.0K") && rows[2].contains("60/1"));
        assert!(rows[3].contains("confirm/confirm") && rows[3].contains("down"));
        assert!(rows[4].starts_with("total") && rows[4].contains("1 up") && rows[4].contains(" 13 "));
        assert_eq!(
            rows[5],
            "hub mw: 2 connection(s), 110 of 32767 queue entries reserved, 900 completions (0 orphans), 40 turns, 70 connection turns, 9 sleeps"
        );
        assert_eq!(rows[6], "device rxe0 port 1:");
        assert_eq!(rows[7], "  rcvd_rnr_err=3  sent_pkts=120");
        assert_eq!(rows[8], "down:");
        assert_eq!(rows[9], "  4: the peer closed the connection");
        let srq = "mwcap-stat 1 pid=7 connections=0\n\
            hub name=mw connections=2 added=5 reserved_entries=110 depth=32767 completions=900 orphans=0 turns=40 connection_turns=70 sleeps=9 \
            srq_slots=1024 srq_shares=24 srq_bytes=4194304 srq_frames=800 srq_grown=8 srq_withheld=0 srq_given_back=5 srq_limit_events=0 srq_refused=0 srq_unclaimed=2 srq_send_slots=256 srq_send_lent=3\n";
        let t = table(srq).unwrap();
        let hub = t.lines().find(|l| l.starts_with("hub ")).unwrap_or_else(|| panic!("{t}"));
        assert_eq!(
            hub,
            "hub mw: 2 connection(s), 110 of 32767 queue entries reserved, 900 completions (0 orphans), 40 turns, 70 connection turns, 9 sleeps; \
             shared receives: 24 of 1024 held by shares (4194304 bytes), 800 frames, 8 grown, 0 withheld, 5 given back, 0 limit events, 0 refused, 2 unclaimed, \
             256 send slots (3 lent)"
        );
        let pooled = srq.replace(
            "srq_send_lent=3\n",
            "srq_send_lent=3 pool_buffers=36 pool_free=30 pool_bytes=6291456 pool_held_bytes=393216 pool_taken=900 pool_empty=4 pool_wakeups=3 \
             pool_windows=35 pool_windows_free=33 pool_windows_lent=880 pool_windows_allocated=37 pool_windows_dropped=2 pool_window_alloc_failures=0 pool_window_waits=0\n",
        );
        let t = table(&pooled).unwrap();
        let hub = t.lines().find(|l| l.starts_with("hub ")).unwrap_or_else(|| panic!("{t}"));
        assert!(
            hub.ends_with(
                "2 unclaimed, 256 send slots (3 lent); shared buffers: 30 of 36 free (6291456 bytes, 393216 held), 900 taken, 4 waits for an empty class, 3 wake-ups; \
                 shared windows: 33 of 35 free, 880 lent, 37 allocated, 2 dropped with their connection, 0 allocations failed, 0 waits for a window"
            ),
            "{hub}"
        );
    }

    #[test]
    fn counters_at_their_limit_and_odd_watch_periods_do_not_panic() {
        let max = u64::MAX;
        let text = format!(
            "mwcap-stat 1 pid=7 connections=1\n\
             conn id=3 peer=- qpn=17 role=client request=mw reply=mw state=up age_ms={max} \
             calls={max} requests={max} calls_failed={max} requests_dropped=1 bytes_read={max}\n"
        );
        let t = table(&text).unwrap();
        assert!(t.contains(&max.to_string()), "{t}");
        assert_eq!(parse_secs("0.5"), Ok(Duration::from_millis(500)));
        for bad in ["0", "-1", "inf", "NaN", "1e30", "two"] {
            assert!(parse_secs(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn a_foreign_socket_or_version_is_refused_with_what_to_do() {
        assert!(table("").unwrap_err().contains("nothing"));
        assert!(table("HTTP/1.1 200 OK\n").unwrap_err().contains("not a mwcap stat socket"));
        assert!(table("mwcap-stat 9 pid=1 connections=0\n").unwrap_err().contains("--raw"));
    }
}
