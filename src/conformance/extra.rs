//! Further scenarios (added with the simulated NIC): flushes on ERR, each
//! bind error, LOCAL_INV with a wrong key, a region's own rkey without
//! remote rights, the rkey from before the bind, READ past the region's end,
//! rebinding after SEND_WITH_INV.
//!
//! None of them invalidates a window twice or invalidates an unbound window
//! (those crash rxe's kernel; the sim's unit tests cover them).
//!
//! Layout: the owner has a 16 KiB region (`MW_BIND` only) filled with a
//! pattern and a control region; the window covers the region's last page
//! unless a scenario says otherwise. Work request ids are unique per side so
//! that a backend can match error completions with what was posted.

use super::{at, Observed, Outcome, QpPair, Rig, Scenario, ScenarioError, Session, Side};
use crate::backend::{
    rkey, Access, Completion, MrInfo, MwInfo, QpState, SendWr, Sge, SgeList, WcOpcode, WcStatus,
};

use QpState::{Err as ERR, Rts as RTS};
use WcOpcode::{BindMw, LocalInv, RdmaRead, Recv, Send};
use WcStatus::{LocQpOpErr, MwBindErr, RemAccessErr, Success, WrFlushErr};

fn scenario(
    name: &'static str,
    about: &'static str,
    run: fn(&Rig<'_>) -> Result<Outcome, ScenarioError>,
    expect: fn() -> Outcome,
) -> Scenario {
    Scenario { name, about, run, expect_spec: expect, expect_rxe: None, rxe_deviation: None }
}

pub(super) fn scenarios() -> Vec<Scenario> {
    vec![
        scenario(
            "forced_err_flushes_outstanding",
            "forcing a QP to ERR flushes its outstanding READ and its posted RECVs, each with its opcode",
            forced_err_flushes_outstanding,
            expect_forced_err_flushes_outstanding,
        ),
        scenario(
            "bind_error_no_mw_bind",
            "binding over a region without MW_BIND: MW_BIND_ERR, chained SEND flushed, binder ERR, peer RTS",
            bind_error_no_mw_bind,
            expect_bind_error,
        ),
        scenario(
            "bind_error_past_mr_end",
            "binding past the region's end: refused at post time by the backend, both QPs stay RTS",
            bind_error_past_mr_end,
            expect_bind_refused,
        ),
        scenario(
            "bind_error_zero_length",
            "binding zero bytes: MW_BIND_ERR, chained SEND flushed, binder ERR, peer RTS",
            bind_error_zero_length,
            expect_bind_error,
        ),
        scenario(
            "bind_error_still_bound",
            "rebinding a window that is still bound: MW_BIND_ERR, chained SEND flushed, binder ERR, peer RTS",
            bind_error_still_bound,
            expect_bind_error_still_bound,
        ),
        scenario(
            "local_inv_wrong_key",
            "LOCAL_INV with another consumer key: LOC_QP_OP_ERR and the posting QP goes to ERR",
            local_inv_wrong_key,
            expect_local_inv_wrong_key,
        ),
        scenario(
            "region_rkey_without_remote_rights",
            "a region registered with MW_BIND only: its window READs fine, its own rkey gets REM_ACCESS_ERR",
            region_rkey_without_remote_rights,
            expect_region_rkey_without_remote_rights,
        ),
        scenario(
            "rkey_from_before_the_bind",
            "the window's rkey from before the bind gets REM_ACCESS_ERR and both QPs go to ERR",
            rkey_from_before_the_bind,
            expect_rkey_from_before_the_bind,
        ),
        scenario(
            "read_past_mr_end",
            "a READ starting inside the window and running past the region's end: REM_ACCESS_ERR, both ERR",
            read_past_mr_end,
            expect_read_past_mr_end,
        ),
        scenario(
            "rebind_after_send_with_inv",
            "after SEND_WITH_INV the window can be bound again with a new key and READ",
            rebind_after_send_with_inv,
            expect_rebind_after_send_with_inv,
        ),
    ]
}

const MR_LEN: usize = 16 * 1024;
const PAGE: usize = 4096;
/// The window: the region's last page.
const WIN_OFF: usize = MR_LEN - PAGE;
const SLOT: usize = 64;
const MSG_LEN: u32 = 12;
const READ_LEN: u32 = 128;

fn pattern(i: usize) -> u8 {
    (i.wrapping_mul(13).wrapping_add(5) & 0xff) as u8
}

struct Owner {
    src: MrInfo,
    ctrl: MrInfo,
    mw: MwInfo,
    rkey: u32,
}

struct Reader {
    dst: MrInfo,
    inbox: MrInfo,
}

/// Objects and `recvs` RECVs on the reader (wr ids 100, 101, ...); the
/// owner's region gets `src_access`.
fn setup(
    s: &mut Session<'_>,
    pair: &QpPair,
    recvs: usize,
    src_access: Access,
) -> Result<(Owner, Reader), ScenarioError> {
    let src = s.mr(Side::Owner, MR_LEN, src_access)?;
    let bytes: Vec<u8> = (0..MR_LEN).map(pattern).collect();
    s.nic(Side::Owner).write_mr(src.id, 0, &bytes).map_err(at("fill the owner's region"))?;
    let ctrl = s.mr(Side::Owner, 4 * SLOT, Access::LOCAL_WRITE)?;
    let mw = s.mw(Side::Owner)?;
    let dst = s.mr(Side::Reader, PAGE, Access::LOCAL_WRITE)?;
    let inbox = s.mr(Side::Reader, 4 * SLOT, Access::LOCAL_WRITE)?;
    for k in 0..recvs {
        let sge = Sge { mr: inbox.id, offset: k * SLOT, len: SLOT as u32 };
        s.nic(Side::Reader)
            .post_recv(pair.reader_qp, 100 + k as u64, sge)
            .map_err(at("post the reader's RECV"))?;
    }
    Ok((Owner { src, ctrl, mw, rkey: mw.rkey }, Reader { dst, inbox }))
}

/// A bind of the window over `mr[offset..offset+len]` with rkey `new`
/// (wr id 1, unsignaled), chained with the SEND of address and rkey (wr id 2).
fn bind_and_send(owner: &Owner, mr: &MrInfo, offset: usize, len: usize, new: u32) -> [SendWr; 2] {
    [
        SendWr::BindMw {
            wr_id: 1,
            signaled: false,
            mw: owner.mw.id,
            rkey: new,
            mr: mr.id,
            offset,
            len,
            access: Access::REMOTE_READ,
        },
        SendWr::Send {
            wr_id: 2,
            signaled: true,
            sge: SgeList::from([Sge { mr: owner.ctrl.id, offset: 0, len: MSG_LEN }]),
        },
    ]
}

/// Bind the window over the region's last page with a fresh key, chained
/// with the SEND. Returns (address, rkey)
/// if the reader got it.
fn expose(
    s: &Session<'_>,
    out: &mut Outcome,
    pair: &QpPair,
    owner: &mut Owner,
) -> Result<Option<(u64, u32)>, ScenarioError> {
    let new = rkey::rebind(owner.rkey, rand::random::<u8>());
    let addr = owner.src.addr + WIN_OFF as u64;
    let mut msg = addr.to_le_bytes().to_vec();
    msg.extend_from_slice(&new.to_le_bytes());
    let o = s.nic(Side::Owner);
    o.write_mr(owner.ctrl.id, 0, &msg).map_err(at("write the window message"))?;
    o.post_send(pair.owner_qp, &bind_and_send(owner, &owner.src, WIN_OFF, PAGE, new))
        .map_err(at("post BIND_MW + SEND"))?;
    owner.rkey = new;
    s.expect_one(out, "owner: SEND chained after BIND_MW", Side::Owner, pair.owner_cq)?;
    let got = s.expect_one(out, "reader: RECV of the window", Side::Reader, pair.reader_cq)?;
    if !got.is_some_and(|c| c.status.is_success()) {
        return Ok(None);
    }
    Ok(Some((addr, new)))
}

/// READ `len` bytes at `remote` through `rk` into the reader's destination (wr id `wr_id`).
#[allow(clippy::too_many_arguments)]
fn read(
    s: &Session<'_>,
    out: &mut Outcome,
    name: &str,
    pair: &QpPair,
    reader: &Reader,
    (remote, rk): (u64, u32),
    len: u32,
    wr_id: u64,
) -> Result<Option<Completion>, ScenarioError> {
    let r = s.nic(Side::Reader);
    r.write_mr(reader.dst.id, 0, &vec![0; PAGE]).map_err(at("clear the READ destination"))?;
    let local = SgeList::from([Sge { mr: reader.dst.id, offset: 0, len }]);
    r.post_send(
        pair.reader_qp,
        &[SendWr::Read { wr_id, signaled: true, local, remote_addr: remote, rkey: rk }],
    )
    .map_err(at("post the READ"))?;
    s.expect_one(out, name, Side::Reader, pair.reader_cq)
}

fn read_matches(s: &Session<'_>, reader: &Reader, src_off: usize, len: u32) -> Result<bool, ScenarioError> {
    let mut got = vec![0u8; len as usize];
    s.nic(Side::Reader).read_mr(reader.dst.id, 0, &mut got).map_err(at("read the destination"))?;
    Ok(got.iter().enumerate().all(|(i, &b)| b == pattern(src_off + i)))
}

fn states(s: &Session<'_>, out: &mut Outcome, pair: &QpPair) -> Result<(), ScenarioError> {
    s.record_state(out, "owner QP", Side::Owner, pair.owner_qp)?;
    s.record_state(out, "reader QP", Side::Reader, pair.reader_qp)
}

// ----- flushes -----

const FLUSHED: [(u64, &str); 3] = [
    (3, "reader: READ outstanding when forced to ERR"),
    (100, "reader: first posted RECV"),
    (101, "reader: second posted RECV"),
];

fn forced_err_flushes_outstanding(rig: &Rig<'_>) -> Result<Outcome, ScenarioError> {
    let mut s = Session::new(rig);
    let pair = s.pair()?;
    let (_, reader) = setup(&mut s, &pair, 2, Access::MW_BIND)?;
    let public = s.mr(Side::Owner, PAGE, Access::REMOTE_READ)?;
    let mut out = Outcome::new();
    // The owner's QP drops what arrives, so the READ stays outstanding (its
    // transport retries take far longer than this scenario).
    s.nic(Side::Owner).set_qp_error(pair.owner_qp).map_err(at("force the owner's QP to ERR"))?;
    let local = SgeList::from([Sge { mr: reader.dst.id, offset: 0, len: READ_LEN }]);
    let wr = SendWr::Read { wr_id: 3, signaled: true, local, remote_addr: public.addr, rkey: public.rkey };
    let r = s.nic(Side::Reader);
    r.post_send(pair.reader_qp, &[wr]).map_err(at("post the READ"))?;
    r.set_qp_error(pair.reader_qp).map_err(at("force the reader's QP to ERR"))?;
    // Send- and receive-queue flushes may interleave in one CQ: match by id.
    let got = s.wait(Side::Reader, pair.reader_cq, FLUSHED.len())?;
    for (id, name) in FLUSHED {
        out.saw(name, got.iter().find(|c| c.wr_id == id));
    }
    let mut clean = vec![0u8; READ_LEN as usize];
    r.read_mr(reader.dst.id, 0, &mut clean).map_err(at("read the destination"))?;
    out.push("reader: the flushed READ wrote nothing", Observed::Fact(clean.iter().all(|&b| b == 0)));
    states(&s, &mut out, &pair)?;
    Ok(out)
}

fn expect_forced_err_flushes_outstanding() -> Outcome {
    Outcome::new()
        .completion(FLUSHED[0].1, WrFlushErr, RdmaRead, None)
        .completion(FLUSHED[1].1, WrFlushErr, Recv, None)
        .completion(FLUSHED[2].1, WrFlushErr, Recv, None)
        .fact("reader: the flushed READ wrote nothing", true)
        .state("owner QP", ERR)
        .state("reader QP", ERR)
}

// ----- bind errors -----

/// Post a bad bind chained with a SEND and record the owner's two
/// completions and both states. The reader never receives anything.
fn bad_bind(s: &Session<'_>, out: &mut Outcome, pair: &QpPair, wrs: &[SendWr]) -> Result<(), ScenarioError> {
    s.nic(Side::Owner).post_send(pair.owner_qp, wrs).map_err(at("post the bad BIND_MW + SEND"))?;
    let got = s.wait(Side::Owner, pair.owner_cq, 2)?;
    out.saw("owner: the bad BIND_MW", got.iter().find(|c| c.wr_id == 1));
    out.saw("owner: the SEND chained after it", got.iter().find(|c| c.wr_id == 2));
    s.record_state(out, "owner QP (the binder)", Side::Owner, pair.owner_qp)?;
    s.record_state(out, "reader QP (the peer)", Side::Reader, pair.reader_qp)
}

fn expect_bind_error() -> Outcome {
    Outcome::new()
        .completion("owner: the bad BIND_MW", MwBindErr, BindMw, None)
        .completion("owner: the SEND chained after it", WrFlushErr, Send, None)
        .state("owner QP (the binder)", ERR)
        .state("reader QP (the peer)", RTS)
}

fn bind_error_with(
    rig: &Rig<'_>,
    bad: fn(&mut Session<'_>, &Owner) -> Result<[SendWr; 2], ScenarioError>,
) -> Result<Outcome, ScenarioError> {
    let mut s = Session::new(rig);
    let pair = s.pair()?;
    let (owner, _) = setup(&mut s, &pair, 1, Access::MW_BIND)?;
    let wrs = bad(&mut s, &owner)?;
    let mut out = Outcome::new();
    bad_bind(&s, &mut out, &pair, &wrs)?;
    Ok(out)
}

fn bind_error_no_mw_bind(rig: &Rig<'_>) -> Result<Outcome, ScenarioError> {
    bind_error_with(rig, |s, owner| {
        let plain = s.mr(Side::Owner, PAGE, Access::LOCAL_WRITE)?;
        Ok(bind_and_send(owner, &plain, 0, PAGE, rkey::rebind(owner.rkey, 1)))
    })
}

fn bind_error_past_mr_end(rig: &Rig<'_>) -> Result<Outcome, ScenarioError> {
    // Both backends check a bind's range against its region before posting
    // (the NIC would answer MW_BIND_ERR and move the QP to ERR, as
    // rdma-facts.md measured on rxe): the post is refused and nothing changes.
    let mut s = Session::new(rig);
    let pair = s.pair()?;
    let (owner, _) = setup(&mut s, &pair, 1, Access::MW_BIND)?;
    let wrs = bind_and_send(&owner, &owner.src, WIN_OFF, 2 * PAGE, rkey::rebind(owner.rkey, 1));
    let refused = matches!(
        s.nic(Side::Owner).post_send(pair.owner_qp, &wrs),
        Err(crate::backend::NicError::OutOfRange { .. })
    );
    let mut out =
        Outcome::new().fact("owner: the bind past the region's end is refused at post time", refused);
    s.record_state(&mut out, "owner QP (the binder)", Side::Owner, pair.owner_qp)?;
    s.record_state(&mut out, "reader QP (the peer)", Side::Reader, pair.reader_qp)?;
    Ok(out)
}

fn expect_bind_refused() -> Outcome {
    Outcome::new()
        .fact("owner: the bind past the region's end is refused at post time", true)
        .state("owner QP (the binder)", RTS)
        .state("reader QP (the peer)", RTS)
}

fn bind_error_zero_length(rig: &Rig<'_>) -> Result<Outcome, ScenarioError> {
    bind_error_with(rig, |_, owner| {
        Ok(bind_and_send(owner, &owner.src, WIN_OFF, 0, rkey::rebind(owner.rkey, 1)))
    })
}

fn bind_error_still_bound(rig: &Rig<'_>) -> Result<Outcome, ScenarioError> {
    let mut s = Session::new(rig);
    let pair = s.pair()?;
    let (mut owner, _) = setup(&mut s, &pair, 1, Access::MW_BIND)?;
    let mut out = Outcome::new();
    if expose(&s, &mut out, &pair, &mut owner)?.is_none() {
        return Ok(out);
    }
    let again = bind_and_send(&owner, &owner.src, 0, PAGE, rkey::rebind(owner.rkey, rand::random::<u8>()));
    bad_bind(&s, &mut out, &pair, &again)?;
    Ok(out)
}

fn expect_bind_error_still_bound() -> Outcome {
    let mut out = Outcome::new()
        .completion("owner: SEND chained after BIND_MW", Success, Send, None)
        .completion("reader: RECV of the window", Success, Recv, Some(MSG_LEN));
    out.observations.extend(expect_bind_error().observations);
    out
}

// ----- invalidation and keys -----

fn local_inv_wrong_key(rig: &Rig<'_>) -> Result<Outcome, ScenarioError> {
    let mut s = Session::new(rig);
    let pair = s.pair()?;
    let (mut owner, _) = setup(&mut s, &pair, 1, Access::MW_BIND)?;
    let mut out = Outcome::new();
    if expose(&s, &mut out, &pair, &mut owner)?.is_none() {
        return Ok(out);
    }
    // The window is bound; only the consumer key is wrong (safe on rxe).
    let inv = SendWr::LocalInv { wr_id: 4, signaled: true, rkey: rkey::inc(owner.rkey) };
    s.nic(Side::Owner).post_send(pair.owner_qp, &[inv]).map_err(at("post LOCAL_INV"))?;
    s.expect_one(&mut out, "owner: LOCAL_INV with a wrong key", Side::Owner, pair.owner_cq)?;
    s.record_state(&mut out, "owner QP (the poster)", Side::Owner, pair.owner_qp)?;
    s.record_state(&mut out, "reader QP", Side::Reader, pair.reader_qp)?;
    Ok(out)
}

fn expect_local_inv_wrong_key() -> Outcome {
    Outcome::new()
        .completion("owner: SEND chained after BIND_MW", Success, Send, None)
        .completion("reader: RECV of the window", Success, Recv, Some(MSG_LEN))
        .completion("owner: LOCAL_INV with a wrong key", LocQpOpErr, LocalInv, None)
        .state("owner QP (the poster)", ERR)
        .state("reader QP", RTS)
}

fn region_rkey_without_remote_rights(rig: &Rig<'_>) -> Result<Outcome, ScenarioError> {
    let mut s = Session::new(rig);
    let pair = s.pair()?;
    let (mut owner, reader) = setup(&mut s, &pair, 1, Access::MW_BIND)?;
    let mut out = Outcome::new();
    let Some((addr, key)) = expose(&s, &mut out, &pair, &mut owner)? else { return Ok(out) };
    read(&s, &mut out, "reader: READ through the window", &pair, &reader, (addr, key), READ_LEN, 3)?;
    out.push(
        "reader: the bytes read are the window's",
        Observed::Fact(read_matches(&s, &reader, WIN_OFF, READ_LEN)?),
    );
    let region = (owner.src.addr, owner.src.rkey);
    read(&s, &mut out, "reader: READ through the region's own rkey", &pair, &reader, region, READ_LEN, 4)?;
    states(&s, &mut out, &pair)?;
    Ok(out)
}

fn expect_region_rkey_without_remote_rights() -> Outcome {
    Outcome::new()
        .completion("owner: SEND chained after BIND_MW", Success, Send, None)
        .completion("reader: RECV of the window", Success, Recv, Some(MSG_LEN))
        .completion("reader: READ through the window", Success, RdmaRead, Some(READ_LEN))
        .fact("reader: the bytes read are the window's", true)
        .completion("reader: READ through the region's own rkey", RemAccessErr, RdmaRead, None)
        .state("owner QP", ERR)
        .state("reader QP", ERR)
}

fn rkey_from_before_the_bind(rig: &Rig<'_>) -> Result<Outcome, ScenarioError> {
    let mut s = Session::new(rig);
    let pair = s.pair()?;
    let (mut owner, reader) = setup(&mut s, &pair, 1, Access::MW_BIND)?;
    let before = owner.rkey;
    let mut out = Outcome::new();
    let Some((addr, _)) = expose(&s, &mut out, &pair, &mut owner)? else { return Ok(out) };
    read(
        &s,
        &mut out,
        "reader: READ with the rkey from before the bind",
        &pair,
        &reader,
        (addr, before),
        READ_LEN,
        3,
    )?;
    states(&s, &mut out, &pair)?;
    Ok(out)
}

fn expect_rkey_from_before_the_bind() -> Outcome {
    Outcome::new()
        .completion("owner: SEND chained after BIND_MW", Success, Send, None)
        .completion("reader: RECV of the window", Success, Recv, Some(MSG_LEN))
        .completion("reader: READ with the rkey from before the bind", RemAccessErr, RdmaRead, None)
        .state("owner QP", ERR)
        .state("reader QP", ERR)
}

fn read_past_mr_end(rig: &Rig<'_>) -> Result<Outcome, ScenarioError> {
    let mut s = Session::new(rig);
    let pair = s.pair()?;
    let (mut owner, reader) = setup(&mut s, &pair, 1, Access::MW_BIND)?;
    let mut out = Outcome::new();
    let Some((addr, key)) = expose(&s, &mut out, &pair, &mut owner)? else { return Ok(out) };
    // The window ends where the region ends: start 64 bytes before, read 128.
    let start = addr + (PAGE - 64) as u64;
    read(
        &s,
        &mut out,
        "reader: READ running past the region's end",
        &pair,
        &reader,
        (start, key),
        READ_LEN,
        3,
    )?;
    states(&s, &mut out, &pair)?;
    Ok(out)
}

fn expect_read_past_mr_end() -> Outcome {
    Outcome::new()
        .completion("owner: SEND chained after BIND_MW", Success, Send, None)
        .completion("reader: RECV of the window", Success, Recv, Some(MSG_LEN))
        .completion("reader: READ running past the region's end", RemAccessErr, RdmaRead, None)
        .state("owner QP", ERR)
        .state("reader QP", ERR)
}

fn rebind_after_send_with_inv(rig: &Rig<'_>) -> Result<Outcome, ScenarioError> {
    let mut s = Session::new(rig);
    let pair = s.pair()?;
    let (mut owner, reader) = setup(&mut s, &pair, 2, Access::MW_BIND)?;
    let sge = Sge { mr: owner.ctrl.id, offset: SLOT, len: SLOT as u32 };
    s.nic(Side::Owner).post_recv(pair.owner_qp, 200, sge).map_err(at("post the owner's RECV"))?;
    let mut out = Outcome::new();
    let Some((addr, first)) = expose(&s, &mut out, &pair, &mut owner)? else { return Ok(out) };
    // The reader releases the window: exactly one invalidation of a bound key.
    let done = Sge { mr: reader.inbox.id, offset: 3 * SLOT, len: 4 };
    let wr =
        SendWr::SendWithInv { wr_id: 5, signaled: true, sge: SgeList::from([done]), invalidate_rkey: first };
    s.nic(Side::Reader).post_send(pair.reader_qp, &[wr]).map_err(at("post SEND_WITH_INV"))?;
    s.expect_one(&mut out, "reader: SEND_WITH_INV", Side::Reader, pair.reader_cq)?;
    let got = s.expect_one(&mut out, "owner: RECV of the SEND_WITH_INV", Side::Owner, pair.owner_cq)?;
    out.push(
        "owner: it names the window's rkey",
        Observed::Fact(got.and_then(|c| c.invalidated_rkey) == Some(first)),
    );
    let Some((_, second)) = expose(&s, &mut out, &pair, &mut owner)? else { return Ok(out) };
    out.push("the new rkey differs from the invalidated one", Observed::Fact(second != first));
    read(&s, &mut out, "reader: READ with the new rkey", &pair, &reader, (addr, second), READ_LEN, 3)?;
    out.push(
        "reader: the bytes read are the window's",
        Observed::Fact(read_matches(&s, &reader, WIN_OFF, READ_LEN)?),
    );
    states(&s, &mut out, &pair)?;
    Ok(out)
}

fn expect_rebind_after_send_with_inv() -> Outcome {
    Outcome::new()
        .completion("owner: SEND chained after BIND_MW", Success, Send, None)
        .completion("reader: RECV of the window", Success, Recv, Some(MSG_LEN))
        .completion("reader: SEND_WITH_INV", Success, Send, None)
        .completion("owner: RECV of the SEND_WITH_INV", Success, Recv, Some(4))
        .fact("owner: it names the window's rkey", true)
        .completion("owner: SEND chained after BIND_MW", Success, Send, None)
        .completion("reader: RECV of the window", Success, Recv, Some(MSG_LEN))
        .fact("the new rkey differs from the invalidated one", true)
        .completion("reader: READ with the new rkey", Success, RdmaRead, Some(READ_LEN))
        .fact("reader: the bytes read are the window's", true)
        .state("owner QP", RTS)
        .state("reader QP", RTS)
}
