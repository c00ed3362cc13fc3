//! `mwcap bench --sim` end to end: every case runs and says how much of
//! each payload it wrote and checked.

use std::process::Command;

/// The result lines of `mwcap bench --sim ARGS` (which must succeed).
fn bench(args: &[&str]) -> Vec<String> {
    let out = Command::new(env!("CARGO_BIN_EXE_mwcap"))
        .args(["bench", "--sim", "--executor", "block_on", "--iters", "40", "--warmup", "5"])
        .args(args)
        .output()
        .expect("running mwcap");
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "mwcap bench --sim {args:?} failed: {out:?}\n{stdout}");
    stdout.lines().filter(|l| l.starts_with("case=")).map(str::to_owned).collect()
}

#[test]
fn stamp_only_runs_every_case_and_says_so() {
    // 16 in flight on 32 buffers: buffers come back to the pool and are
    // stamped again for later calls, which must pass as theirs.
    let lines = bench(&["--stamp-only", "--sizes", "64,4096,65536", "--inflight", "1,16"]);
    // Per policy: reply_read, request_read and delegate_read at 3 sizes x
    // 2 in-flight counts, plus rpc twice on the first; async with the
    // server apart and joined, and sans-IO (which cannot delegate: no
    // delegate_read) each.
    assert_eq!(lines.len(), 2 * (2 + 2 * 18) + (2 + 2 * 12), "{lines:#?}");
    assert!(lines.iter().all(|l| l.contains(" check=stamp ")), "{lines:#?}");
}

#[test]
fn every_byte_is_the_default() {
    let lines = bench(&["--sizes", "64,4096", "--inflight", "1", "--policy", "mw"]);
    assert_eq!(lines.len(), 2 * (1 + 3 * 2) + (1 + 2 * 2), "{lines:#?}");
    assert!(lines.iter().all(|l| l.contains(" check=every_byte ")), "{lines:#?}");
}

#[test]
fn the_server_runs_apart_and_joined_and_each_line_says_where() {
    let count = |lines: &[String], s: &str| lines.iter().filter(|l| l.contains(s)).count();
    let both = bench(&["--sizes", "64", "--inflight", "1", "--policy", "mw"]);
    // rpc and the three reads: async apart, async joined; sans-IO (joined)
    // all but delegate_read.
    assert_eq!(both.len(), 11, "{both:#?}");
    assert_eq!(count(&both, " executor=block_on server=apart "), 4, "{both:#?}");
    assert_eq!(count(&both, " executor=block_on server=joined "), 4, "{both:#?}");
    assert_eq!(count(&both, " executor=none server=joined "), 3, "{both:#?}");
    let apart = bench(&["--sizes", "64", "--inflight", "1", "--policy", "mw", "--server", "apart"]);
    assert_eq!(apart.len(), 7, "{apart:#?}");
    assert_eq!(count(&apart, " executor=block_on server=apart "), 4, "{apart:#?}");
}

#[test]
fn delegate_read_redeems_a_token_under_both_policies_every_byte_checked() {
    // The server delegates a range written with each call's payload to the
    // client's identity; the client redeems the token and checks what it
    // read (a range not this call's fails the run). 16 in flight: the
    // server's slots are written again once their delegations are over.
    let lines = bench(&["--cases", "delegate_read", "--sizes", "64,65536", "--inflight", "1,16"]);
    assert_eq!(lines.len(), 2 * 2 * 2 * 2, "{lines:#?}");
    assert!(lines.iter().all(|l| l.starts_with("case=delegate_read ") && l.contains(" check=every_byte ")));
    for policy in ["mw", "confirm"] {
        let n = lines.iter().filter(|l| l.contains(&format!(" policy={policy} "))).count();
        assert_eq!(n, 8, "{policy}: {lines:#?}");
    }
    let stamped = bench(&["--cases", "delegate_read", "--sizes", "4096", "--inflight", "1", "--stamp-only"]);
    assert_eq!(stamped.len(), 4, "{stamped:#?}");
    assert!(stamped.iter().all(|l| l.contains(" check=stamp ")), "{stamped:#?}");
}
