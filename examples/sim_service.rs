//! Testing your own service on the simulated NIC.
//!
//! A toy "blob service": the owner binds a window over a blob, chained with
//! the SEND that tells the reader its address and rkey; the reader READs it
//! and releases the window with SEND_WITH_INV. The example runs it once on a
//! healthy fabric and once with the link cut mid-way, and checks with the
//! oracle that nothing stays exposed and that no invalidation would crash rxe.
//!
//! Run with `cargo run --example sim_service`.

use std::time::Duration;

use mwcap::backend::{rkey, Access, Nic, NicError, SendWr, Sge, SgeList, WcStatus};
use mwcap::sim::{DeviceConfig, Fabric, FabricConfig, Faults, Pair, Progress};

const BLOB: &[u8] = b"a blob served by the owner through a type-2 window";

/// One exchange. Returns the bytes the reader got, if any.
fn serve_once(p: &Pair, cut_link_after_bind: bool) -> Result<Option<Vec<u8>>, NicError> {
    let (owner, reader) = (&p.a, &p.b);
    let blob = owner.nic.reg_mr(4096, Access::MW_BIND)?;
    owner.nic.write_mr(blob.id, 0, BLOB)?;
    let msg = owner.nic.reg_mr(64, Access::LOCAL_WRITE)?;
    let mw = owner.nic.alloc_mw()?;
    let inbox = reader.nic.reg_mr(64, Access::LOCAL_WRITE)?;
    let dst = reader.nic.reg_mr(4096, Access::LOCAL_WRITE)?;
    reader.nic.post_recv(reader.qp, 10, Sge { mr: inbox.id, offset: 0, len: 64 })?;
    owner.nic.post_recv(owner.qp, 20, Sge { mr: msg.id, offset: 32, len: 32 })?;

    // Owner: bind over exactly the blob, chained with the SEND of (addr, rkey).
    let rk = rkey::rebind(mw.rkey, 0x3c);
    let mut hello = blob.addr.to_le_bytes().to_vec();
    hello.extend_from_slice(&rk.to_le_bytes());
    owner.nic.write_mr(msg.id, 0, &hello)?;
    let len = BLOB.len();
    owner.nic.post_send(
        owner.qp,
        &[
            SendWr::BindMw {
                wr_id: 1,
                signaled: false,
                mw: mw.id,
                rkey: rk,
                mr: blob.id,
                offset: 0,
                len,
                access: Access::REMOTE_READ,
            },
            SendWr::Send {
                wr_id: 2,
                signaled: true,
                sge: SgeList::from([Sge { mr: msg.id, offset: 0, len: 12 }]),
            },
        ],
    )?;
    p.fabric.run_until_idle();
    assert!(reader.poll().iter().all(|c| c.status == WcStatus::Success));

    // The oracle: the reader's QP can reach exactly the blob, nothing else.
    let exposed = p.fabric.exposure(owner.device(), reader.addr);
    assert_eq!(exposed.len(), 1);
    assert_eq!(exposed[0].bytes, 0..len);

    if cut_link_after_bind {
        p.fabric.cut_link(owner.device(), reader.device());
    }
    let local = SgeList::from([Sge { mr: dst.id, offset: 0, len: len as u32 }]);
    reader.nic.post_send(
        reader.qp,
        &[SendWr::Read { wr_id: 3, signaled: true, local, remote_addr: blob.addr, rkey: rk }],
    )?;
    p.fabric.run_until_idle();
    let read_ok = reader.poll().iter().any(|c| c.wr_id == 3 && c.status == WcStatus::Success);
    if !read_ok {
        // The reader's QP is in ERR (retries exhausted). The owner must not
        // reuse the blob until it has NIC evidence: here, moving its own QP
        // to ERR (a real service would also time out and rebuild).
        owner.nic.set_qp_error(owner.qp)?;
        p.fabric.run_until_idle();
        owner.poll();
        assert!(p.fabric.in_flight().is_empty(), "no READ may still land after the flush");
        return Ok(None);
    }
    // Release: SEND_WITH_INV of exactly the bound rkey.
    let wr = SendWr::SendWithInv { wr_id: 4, signaled: true, sge: SgeList::new(), invalidate_rkey: rk };
    reader.nic.post_send(reader.qp, &[wr])?;
    p.fabric.run_until_idle();
    let got = owner.poll();
    assert_eq!(got.last().and_then(|c| c.invalidated_rkey), Some(rk));
    assert!(p.fabric.exposure(owner.device(), reader.addr).is_empty(), "nothing stays exposed");
    let mut out = vec![0; len];
    reader.nic.read_mr(dst.id, 0, &mut out)?;
    Ok(Some(out))
}

fn main() -> Result<(), NicError> {
    let faults = Faults { retry_cnt: 3, ack_timeout: Duration::from_micros(100), ..Faults::default() };
    for cut in [false, true] {
        let cfg = FabricConfig { faults, progress: Progress::Manual, ..FabricConfig::with_seed(42) };
        let fabric = Fabric::new(cfg);
        let p = Pair::new(&fabric, DeviceConfig::spec(), DeviceConfig::spec())?;
        let got = serve_once(&p, cut)?;
        match &got {
            Some(bytes) => assert_eq!(bytes, BLOB),
            None => assert!(cut, "only the cut link may fail the READ"),
        }
        assert!(fabric.would_crash_rxe().is_empty());
        println!(
            "link cut: {cut:5}  read: {:5}  virtual time: {:?}  reader counters: {:?}",
            got.is_some(),
            fabric.now(),
            fabric.qp_counters(p.b.addr)
        );
    }
    Ok(())
}
