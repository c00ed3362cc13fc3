//! The basic scenarios: the type-2 window behaviours of issue 2 §5.
//!
//! Layout shared by all of them: the owner has a 16 KiB region filled with a
//! known pattern and binds a window over its second page; the rkey and the
//! window's address travel to the reader in the SEND chained after the bind,
//! and the reader READs with a two-entry scatter list.

use super::{at, Outcome, QpPair, Scenario, ScenarioError, Session, Side};
use crate::backend::{
    rkey, Access, Completion, MrInfo, MwInfo, QpState, SendWr, Sge, SgeList, WcOpcode, WcStatus,
};

use QpState::{Err as ERR, Rts as RTS};
use WcOpcode::{LocalInv, RdmaRead, Recv, Send};
use WcStatus::{RemAccessErr, Success};

pub(super) fn scenarios() -> Vec<Scenario> {
    vec![
        Scenario {
            name: "bind_send_then_read_inside",
            about: "a bind chained with a SEND lets the peer READ inside the window",
            run: bind_send_then_read_inside,
            expect_spec: expect_bind_send_then_read_inside,
            expect_rxe: None,
            rxe_deviation: None,
        },
        Scenario {
            name: "read_from_other_qp_fails",
            about: "a READ through the rkey from another QP fails and that pair goes to ERR; the bound pair survives",
            run: read_from_other_qp_fails,
            expect_spec: expect_read_from_other_qp_fails,
            expect_rxe: None,
            rxe_deviation: None,
        },
        Scenario {
            name: "local_inv_then_read_fails",
            about: "after LOCAL_INV a READ fails with a remote access error and both QPs go to ERR",
            run: local_inv_then_read_fails,
            expect_spec: expect_local_inv_then_read_fails,
            expect_rxe: None,
            rxe_deviation: None,
        },
        Scenario {
            name: "send_with_inv_invalidates",
            about: "SEND_WITH_INV is reported with the invalidated rkey, and the window is invalid afterwards",
            run: send_with_inv_invalidates,
            expect_spec: expect_send_with_inv_invalidates,
            expect_rxe: None,
            rxe_deviation: None,
        },
        Scenario {
            name: "rebind_new_key_old_fails",
            about: "a rebind with a new consumer key works and the old rkey fails",
            run: rebind_new_key_old_fails,
            expect_spec: expect_rebind_new_key_old_fails,
            expect_rxe: None,
            rxe_deviation: None,
        },
        Scenario {
            name: "read_outside_window_inside_mr",
            about: "a READ outside the window but inside its region fails with a remote access error",
            run: read_outside_window_inside_mr,
            expect_spec: expect_read_outside_window_spec,
            expect_rxe: Some(expect_read_outside_window_rxe),
            rxe_deviation: Some(
                "rxe checks a window's READ only against the bounds of the underlying region, not the \
                 window's: the READ succeeds and returns bytes outside the window",
            ),
        },
    ]
}

const MR_LEN: usize = 16 * 1024;
const WIN_OFF: usize = 4096;
const WIN_LEN: usize = 4096;
/// The message carrying a window: address (u64 LE) and rkey (u32 LE).
const MSG_LEN: u32 = 12;
/// Receive slots on each side.
const SLOT: usize = 64;
/// Owner's control region: the outgoing message at 0, receive slots from SLOT.
const CTRL_LEN: usize = 4 * SLOT;
/// READ size inside the window, and where it starts inside the window.
const READ_LEN: u32 = 256;
const READ_AT: usize = 100;
/// Where the second scatter entry of a READ lands in the reader's region.
const SPLIT_AT: usize = 2048;

fn pattern(i: usize) -> u8 {
    (i.wrapping_mul(7).wrapping_add(3) & 0xff) as u8
}

/// The owner's objects.
struct Owner {
    src: MrInfo,
    ctrl: MrInfo,
    mw: MwInfo,
    /// The window's current rkey, tracked by the caller as the backend
    /// interface requires.
    rkey: u32,
}

/// The reader's objects: READ destination and receive slots.
struct Reader {
    dst: MrInfo,
    inbox: MrInfo,
}

fn setup(s: &mut Session<'_>, pair: &QpPair, recvs: usize) -> Result<(Owner, Reader), ScenarioError> {
    let src = s.mr(Side::Owner, MR_LEN, Access::MW_BIND)?;
    let bytes: Vec<u8> = (0..MR_LEN).map(pattern).collect();
    s.nic(Side::Owner).write_mr(src.id, 0, &bytes).map_err(at("fill the owner's region"))?;
    let ctrl = s.mr(Side::Owner, CTRL_LEN, Access::LOCAL_WRITE)?;
    let mw = s.mw(Side::Owner)?;
    let dst = s.mr(Side::Reader, MR_LEN, Access::LOCAL_WRITE)?;
    let inbox = s.mr(Side::Reader, 4 * SLOT, Access::LOCAL_WRITE)?;
    for k in 0..recvs {
        let sge = Sge { mr: inbox.id, offset: k * SLOT, len: SLOT as u32 };
        s.nic(Side::Reader)
            .post_recv(pair.reader_qp, 100 + k as u64, sge)
            .map_err(at("post the reader's RECV"))?;
    }
    Ok((Owner { src, ctrl, mw, rkey: mw.rkey }, Reader { dst, inbox }))
}

/// Bind the window over the owner's second page with a fresh key, chained
/// with the SEND that carries address and rkey into the reader's receive
/// `slot`. Returns what the reader decoded, or `None` if nothing arrived.
fn expose(
    s: &Session<'_>,
    out: &mut Outcome,
    names: [&str; 2],
    pair: &QpPair,
    owner: &mut Owner,
    reader: &Reader,
    slot: usize,
) -> Result<Option<(u64, u32)>, ScenarioError> {
    let new = rkey::rebind(owner.rkey, rand::random::<u8>());
    let addr = owner.src.addr + WIN_OFF as u64;
    let mut msg = addr.to_le_bytes().to_vec();
    msg.extend_from_slice(&new.to_le_bytes());
    let o = s.nic(Side::Owner);
    o.write_mr(owner.ctrl.id, 0, &msg).map_err(at("write the window message"))?;
    let chain = [
        SendWr::BindMw {
            wr_id: 1,
            signaled: false,
            mw: owner.mw.id,
            rkey: new,
            mr: owner.src.id,
            offset: WIN_OFF,
            len: WIN_LEN,
            access: Access::REMOTE_READ,
        },
        SendWr::Send {
            wr_id: 2,
            signaled: true,
            sge: SgeList::from([Sge { mr: owner.ctrl.id, offset: 0, len: MSG_LEN }]),
        },
    ];
    o.post_send(pair.owner_qp, &chain).map_err(at("post BIND_MW + SEND"))?;
    owner.rkey = new;
    s.expect_one(out, names[0], Side::Owner, pair.owner_cq)?;
    let Some(c) = s.expect_one(out, names[1], Side::Reader, pair.reader_cq)? else { return Ok(None) };
    if !c.status.is_success() {
        return Ok(None);
    }
    let mut buf = [0u8; MSG_LEN as usize];
    s.nic(Side::Reader)
        .read_mr(reader.inbox.id, slot * SLOT, &mut buf)
        .map_err(at("read the window message"))?;
    let (a, k) = buf.split_at(8);
    Ok(Some((
        u64::from_le_bytes(a.try_into().expect("8 bytes")),
        u32::from_le_bytes(k.try_into().expect("4 bytes")),
    )))
}

/// READ `len` bytes at `remote_addr` through `rkey` on the reader's `qp`
/// into two scatter entries of the reader's region (zeroed first).
fn read(
    s: &Session<'_>,
    out: &mut Outcome,
    name: &str,
    (qp, cq): (crate::backend::QpId, crate::backend::CqId),
    reader: &Reader,
    (remote_addr, rkey): (u64, u32),
    len: u32,
) -> Result<Option<Completion>, ScenarioError> {
    let r = s.nic(Side::Reader);
    r.write_mr(reader.dst.id, 0, &vec![0; MR_LEN]).map_err(at("clear the READ destination"))?;
    let first = len / 2;
    let local = SgeList::from([
        Sge { mr: reader.dst.id, offset: 0, len: first },
        Sge { mr: reader.dst.id, offset: SPLIT_AT, len: len - first },
    ]);
    r.post_send(qp, &[SendWr::Read { wr_id: 3, signaled: true, local, remote_addr, rkey }])
        .map_err(at("post the READ"))?;
    s.expect_one(out, name, Side::Reader, cq)
}

/// Whether the reader's two scatter entries hold the owner's bytes at
/// `src_off..src_off+len` of its region.
fn read_matches(s: &Session<'_>, reader: &Reader, src_off: usize, len: u32) -> Result<bool, ScenarioError> {
    let first = (len / 2) as usize;
    let mut got = vec![0u8; len as usize];
    let r = s.nic(Side::Reader);
    r.read_mr(reader.dst.id, 0, &mut got[..first]).map_err(at("read the destination"))?;
    r.read_mr(reader.dst.id, SPLIT_AT, &mut got[first..]).map_err(at("read the destination"))?;
    Ok(got.iter().enumerate().all(|(i, &b)| b == pattern(src_off + i)))
}

const SENT: &str = "owner: SEND chained after BIND_MW";
const RECEIVED: &str = "reader: RECV of the window's address and rkey";

fn bind_send_then_read_inside(rig: &super::Rig<'_>) -> Result<Outcome, ScenarioError> {
    let mut s = Session::new(rig);
    let pair = s.pair()?;
    let (mut owner, reader) = setup(&mut s, &pair, 1)?;
    let mut out = Outcome::new();
    let Some((addr, key)) = expose(&s, &mut out, [SENT, RECEIVED], &pair, &mut owner, &reader, 0)? else {
        return Ok(out);
    };
    let qp = (pair.reader_qp, pair.reader_cq);
    read(
        &s,
        &mut out,
        "reader: READ inside the window",
        qp,
        &reader,
        (addr + READ_AT as u64, key),
        READ_LEN,
    )?;
    out.push(
        "reader: the bytes read are the window's",
        read_matches(&s, &reader, WIN_OFF + READ_AT, READ_LEN)?.into(),
    );
    s.record_state(&mut out, "owner QP", Side::Owner, pair.owner_qp)?;
    s.record_state(&mut out, "reader QP", Side::Reader, pair.reader_qp)?;
    Ok(out)
}

fn expect_bind_send_then_read_inside() -> Outcome {
    Outcome::new()
        .completion(SENT, Success, Send, None)
        .completion(RECEIVED, Success, Recv, Some(MSG_LEN))
        .completion("reader: READ inside the window", Success, RdmaRead, Some(READ_LEN))
        .fact("reader: the bytes read are the window's", true)
        .state("owner QP", RTS)
        .state("reader QP", RTS)
}

fn read_from_other_qp_fails(rig: &super::Rig<'_>) -> Result<Outcome, ScenarioError> {
    let mut s = Session::new(rig);
    let bound = s.pair()?;
    let other = s.pair()?;
    let (mut owner, reader) = setup(&mut s, &bound, 1)?;
    let mut out = Outcome::new();
    let Some((addr, key)) = expose(&s, &mut out, [SENT, RECEIVED], &bound, &mut owner, &reader, 0)? else {
        return Ok(out);
    };
    let via_other = (other.reader_qp, other.reader_cq);
    read(
        &s,
        &mut out,
        "reader: READ with the rkey on another QP",
        via_other,
        &reader,
        (addr, key),
        READ_LEN,
    )?;
    s.record_state(&mut out, "owner QP of the other pair", Side::Owner, other.owner_qp)?;
    s.record_state(&mut out, "reader QP of the other pair", Side::Reader, other.reader_qp)?;
    s.record_state(&mut out, "owner QP of the bound pair", Side::Owner, bound.owner_qp)?;
    s.record_state(&mut out, "reader QP of the bound pair", Side::Reader, bound.reader_qp)?;
    let via_bound = (bound.reader_qp, bound.reader_cq);
    read(
        &s,
        &mut out,
        "reader: READ on the bound pair afterwards",
        via_bound,
        &reader,
        (addr, key),
        READ_LEN,
    )?;
    out.push("reader: the bytes read are the window's", read_matches(&s, &reader, WIN_OFF, READ_LEN)?.into());
    Ok(out)
}

fn expect_read_from_other_qp_fails() -> Outcome {
    Outcome::new()
        .completion(SENT, Success, Send, None)
        .completion(RECEIVED, Success, Recv, Some(MSG_LEN))
        .completion("reader: READ with the rkey on another QP", RemAccessErr, RdmaRead, None)
        .state("owner QP of the other pair", ERR)
        .state("reader QP of the other pair", ERR)
        .state("owner QP of the bound pair", RTS)
        .state("reader QP of the bound pair", RTS)
        .completion("reader: READ on the bound pair afterwards", Success, RdmaRead, Some(READ_LEN))
        .fact("reader: the bytes read are the window's", true)
}

fn local_inv_then_read_fails(rig: &super::Rig<'_>) -> Result<Outcome, ScenarioError> {
    let mut s = Session::new(rig);
    let pair = s.pair()?;
    let (mut owner, reader) = setup(&mut s, &pair, 1)?;
    let mut out = Outcome::new();
    let Some((addr, key)) = expose(&s, &mut out, [SENT, RECEIVED], &pair, &mut owner, &reader, 0)? else {
        return Ok(out);
    };
    let qp = (pair.reader_qp, pair.reader_cq);
    read(&s, &mut out, "reader: READ before LOCAL_INV", qp, &reader, (addr, key), READ_LEN)?;
    // Exactly one invalidation of a bound window (a second one crashes rxe).
    let inv = SendWr::LocalInv { wr_id: 4, signaled: true, rkey: owner.rkey };
    s.nic(Side::Owner).post_send(pair.owner_qp, &[inv]).map_err(at("post LOCAL_INV"))?;
    s.expect_one(&mut out, "owner: LOCAL_INV", Side::Owner, pair.owner_cq)?;
    s.record_state(&mut out, "owner QP after LOCAL_INV", Side::Owner, pair.owner_qp)?;
    s.record_state(&mut out, "reader QP after LOCAL_INV", Side::Reader, pair.reader_qp)?;
    read(&s, &mut out, "reader: READ after LOCAL_INV", qp, &reader, (addr, key), READ_LEN)?;
    s.record_state(&mut out, "owner QP", Side::Owner, pair.owner_qp)?;
    s.record_state(&mut out, "reader QP", Side::Reader, pair.reader_qp)?;
    Ok(out)
}

fn expect_local_inv_then_read_fails() -> Outcome {
    Outcome::new()
        .completion(SENT, Success, Send, None)
        .completion(RECEIVED, Success, Recv, Some(MSG_LEN))
        .completion("reader: READ before LOCAL_INV", Success, RdmaRead, Some(READ_LEN))
        .completion("owner: LOCAL_INV", Success, LocalInv, None)
        .state("owner QP after LOCAL_INV", RTS)
        .state("reader QP after LOCAL_INV", RTS)
        .completion("reader: READ after LOCAL_INV", RemAccessErr, RdmaRead, None)
        .state("owner QP", ERR)
        .state("reader QP", ERR)
}

/// The reader's "done" message, sent with SEND_WITH_INV.
const DONE: &[u8] = b"done";

fn send_with_inv_invalidates(rig: &super::Rig<'_>) -> Result<Outcome, ScenarioError> {
    let mut s = Session::new(rig);
    let pair = s.pair()?;
    let (mut owner, reader) = setup(&mut s, &pair, 1)?;
    let sge = Sge { mr: owner.ctrl.id, offset: SLOT, len: SLOT as u32 };
    s.nic(Side::Owner).post_recv(pair.owner_qp, 200, sge).map_err(at("post the owner's RECV"))?;
    let mut out = Outcome::new();
    let Some((addr, key)) = expose(&s, &mut out, [SENT, RECEIVED], &pair, &mut owner, &reader, 0)? else {
        return Ok(out);
    };
    let qp = (pair.reader_qp, pair.reader_cq);
    read(&s, &mut out, "reader: READ before SEND_WITH_INV", qp, &reader, (addr, key), READ_LEN)?;
    let r = s.nic(Side::Reader);
    r.write_mr(reader.inbox.id, 3 * SLOT, DONE).map_err(at("write the done message"))?;
    let done = Sge { mr: reader.inbox.id, offset: 3 * SLOT, len: DONE.len() as u32 };
    // The rkey is bound right now and invalidated exactly once.
    let wr =
        SendWr::SendWithInv { wr_id: 5, signaled: true, sge: SgeList::from([done]), invalidate_rkey: key };
    r.post_send(pair.reader_qp, &[wr]).map_err(at("post SEND_WITH_INV"))?;
    s.expect_one(&mut out, "reader: SEND_WITH_INV", Side::Reader, pair.reader_cq)?;
    let got = s.expect_one(&mut out, "owner: RECV of the SEND_WITH_INV", Side::Owner, pair.owner_cq)?;
    let named = got.as_ref().and_then(|c| c.invalidated_rkey) == Some(owner.rkey);
    out.push("owner: the completion names the window's rkey as invalidated", named.into());
    s.record_state(&mut out, "owner QP after SEND_WITH_INV", Side::Owner, pair.owner_qp)?;
    read(&s, &mut out, "reader: READ after SEND_WITH_INV", qp, &reader, (addr, key), READ_LEN)?;
    s.record_state(&mut out, "owner QP", Side::Owner, pair.owner_qp)?;
    s.record_state(&mut out, "reader QP", Side::Reader, pair.reader_qp)?;
    Ok(out)
}

fn expect_send_with_inv_invalidates() -> Outcome {
    Outcome::new()
        .completion(SENT, Success, Send, None)
        .completion(RECEIVED, Success, Recv, Some(MSG_LEN))
        .completion("reader: READ before SEND_WITH_INV", Success, RdmaRead, Some(READ_LEN))
        .completion("reader: SEND_WITH_INV", Success, Send, None)
        .completion("owner: RECV of the SEND_WITH_INV", Success, Recv, Some(DONE.len() as u32))
        .fact("owner: the completion names the window's rkey as invalidated", true)
        .state("owner QP after SEND_WITH_INV", RTS)
        .completion("reader: READ after SEND_WITH_INV", RemAccessErr, RdmaRead, None)
        .state("owner QP", ERR)
        .state("reader QP", ERR)
}

const RESENT: &str = "owner: SEND chained after the rebind";
const RERECEIVED: &str = "reader: RECV of the new rkey";

fn rebind_new_key_old_fails(rig: &super::Rig<'_>) -> Result<Outcome, ScenarioError> {
    let mut s = Session::new(rig);
    let pair = s.pair()?;
    let (mut owner, reader) = setup(&mut s, &pair, 2)?;
    let mut out = Outcome::new();
    let Some((addr, old)) = expose(&s, &mut out, [SENT, RECEIVED], &pair, &mut owner, &reader, 0)? else {
        return Ok(out);
    };
    let qp = (pair.reader_qp, pair.reader_cq);
    read(&s, &mut out, "reader: READ with the first rkey", qp, &reader, (addr, old), READ_LEN)?;
    let inv = SendWr::LocalInv { wr_id: 4, signaled: true, rkey: owner.rkey };
    s.nic(Side::Owner).post_send(pair.owner_qp, &[inv]).map_err(at("post LOCAL_INV"))?;
    s.expect_one(&mut out, "owner: LOCAL_INV", Side::Owner, pair.owner_cq)?;
    let Some((addr2, new)) = expose(&s, &mut out, [RESENT, RERECEIVED], &pair, &mut owner, &reader, 1)?
    else {
        return Ok(out);
    };
    let same_index_new_key = rkey::index(new) == rkey::index(old) && new != old && addr2 == addr;
    out.push("the new rkey keeps the window's index with another key", same_index_new_key.into());
    read(&s, &mut out, "reader: READ with the new rkey", qp, &reader, (addr, new), READ_LEN)?;
    out.push("reader: the bytes read are the window's", read_matches(&s, &reader, WIN_OFF, READ_LEN)?.into());
    read(&s, &mut out, "reader: READ with the old rkey", qp, &reader, (addr, old), READ_LEN)?;
    s.record_state(&mut out, "owner QP", Side::Owner, pair.owner_qp)?;
    s.record_state(&mut out, "reader QP", Side::Reader, pair.reader_qp)?;
    Ok(out)
}

fn expect_rebind_new_key_old_fails() -> Outcome {
    Outcome::new()
        .completion(SENT, Success, Send, None)
        .completion(RECEIVED, Success, Recv, Some(MSG_LEN))
        .completion("reader: READ with the first rkey", Success, RdmaRead, Some(READ_LEN))
        .completion("owner: LOCAL_INV", Success, LocalInv, None)
        .completion(RESENT, Success, Send, None)
        .completion(RERECEIVED, Success, Recv, Some(MSG_LEN))
        .fact("the new rkey keeps the window's index with another key", true)
        .completion("reader: READ with the new rkey", Success, RdmaRead, Some(READ_LEN))
        .fact("reader: the bytes read are the window's", true)
        .completion("reader: READ with the old rkey", RemAccessErr, RdmaRead, None)
        .state("owner QP", ERR)
        .state("reader QP", ERR)
}

/// Bytes READ from the region's first page, outside the window.
const OUTSIDE_LEN: u32 = 64;
const OUTSIDE_READ: &str = "reader: READ outside the window, inside the region";
const OUTSIDE_BYTES: &str = "reader: bytes from outside the window arrived";

fn read_outside_window_inside_mr(rig: &super::Rig<'_>) -> Result<Outcome, ScenarioError> {
    let mut s = Session::new(rig);
    let pair = s.pair()?;
    let (mut owner, reader) = setup(&mut s, &pair, 1)?;
    let mut out = Outcome::new();
    let Some((addr, key)) = expose(&s, &mut out, [SENT, RECEIVED], &pair, &mut owner, &reader, 0)? else {
        return Ok(out);
    };
    // The region starts WIN_OFF bytes before the window.
    let start = addr - WIN_OFF as u64;
    let qp = (pair.reader_qp, pair.reader_cq);
    read(&s, &mut out, OUTSIDE_READ, qp, &reader, (start, key), OUTSIDE_LEN)?;
    out.push(OUTSIDE_BYTES, read_matches(&s, &reader, 0, OUTSIDE_LEN)?.into());
    s.record_state(&mut out, "owner QP", Side::Owner, pair.owner_qp)?;
    s.record_state(&mut out, "reader QP", Side::Reader, pair.reader_qp)?;
    Ok(out)
}

fn expect_read_outside_window_spec() -> Outcome {
    Outcome::new()
        .completion(SENT, Success, Send, None)
        .completion(RECEIVED, Success, Recv, Some(MSG_LEN))
        .completion(OUTSIDE_READ, RemAccessErr, RdmaRead, None)
        .fact(OUTSIDE_BYTES, false)
        .state("owner QP", ERR)
        .state("reader QP", ERR)
}

fn expect_read_outside_window_rxe() -> Outcome {
    Outcome::new()
        .completion(SENT, Success, Send, None)
        .completion(RECEIVED, Success, Recv, Some(MSG_LEN))
        .completion(OUTSIDE_READ, Success, RdmaRead, Some(OUTSIDE_LEN))
        .fact(OUTSIDE_BYTES, true)
        .state("owner QP", RTS)
        .state("reader QP", RTS)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn table_is_well_formed() {
        let t = super::super::table();
        let mut names: Vec<_> = t.iter().map(|s| s.name).collect();
        names.sort_unstable();
        names.dedup();
        assert_eq!(names.len(), t.len(), "scenario names must be unique");
        for s in &t {
            assert_eq!(
                s.expect_rxe.is_some(),
                s.rxe_deviation.is_some(),
                "{}: deviation text and record go together",
                s.name
            );
            assert!(!(s.expect_spec)().observations.is_empty());
        }
    }

    #[test]
    fn pattern_is_not_constant() {
        assert!((0..64).map(pattern).any(|b| b != pattern(0)));
    }
}
