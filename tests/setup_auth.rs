//! A listening `Endpoint` creates nothing for a client before it proved
//! the key: every NIC object (queue pair, completion queue, region,
//! window, the probe's throw-away pair included) is counted as it is
//! created on a simulated NIC, while a client stops half way through the
//! auth phase, after it failed, and, for contrast, after a client that has
//! the key. What the endpoint makes for itself (its completion queue, and
//! its probe, run once as it is built) is counted before the first client.

#![cfg(not(loom))]

use mwcap::backend::NicOps;
use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use futures::executor::LocalPool;
use futures::task::LocalSpawnExt;
use mwcap::backend::*;
use mwcap::bootstrap::{
    decode_auth, encode_auth, Auth, AuthFrame, AuthMode, BootstrapError, Key, RejectReason,
    AUTH_HELLO_BODY_LEN, HEADER_LEN, MAC_LEN, NONCE_LEN,
};
use mwcap::conn::{Endpoint, EndpointDriver, Policies, Policy, PolicyChoice, ProbeCache, SetupError};
use mwcap::sim::{DeviceConfig, Fabric, SimNic};

const T: Duration = Duration::from_secs(20);

/// A simulated NIC that counts the objects created on it.
#[derive(Clone)]
struct Counting {
    nic: SimNic,
    created: Arc<AtomicUsize>,
}

impl Counting {
    fn new(nic: SimNic) -> Counting {
        Counting { nic, created: Arc::new(AtomicUsize::new(0)) }
    }
    fn created(&self) -> usize {
        self.created.load(Ordering::SeqCst)
    }
    fn count<T>(&self, r: Result<T, NicError>) -> Result<T, NicError> {
        self.created.fetch_add(1, Ordering::SeqCst);
        r
    }
}

impl NicOps for Counting {
    fn device_info(&self) -> DeviceInfo {
        self.nic.device_info()
    }
    fn reg_mr(&self, len: usize, access: Access) -> Result<MrInfo, NicError> {
        self.count(self.nic.reg_mr(len, access))
    }
    fn reg_memory(
        &self,
        mem: &std::sync::Arc<mwcap::backend::Memory>,
        access: Access,
    ) -> Result<MrInfo, NicError> {
        self.count(self.nic.reg_memory(mem, access))
    }
    fn dereg_mr(&self, mr: MrId) -> Result<(), NicError> {
        self.nic.dereg_mr(mr)
    }
    fn write_mr(&self, mr: MrId, offset: usize, data: &[u8]) -> Result<(), NicError> {
        self.nic.write_mr(mr, offset, data)
    }
    fn read_mr(&self, mr: MrId, offset: usize, out: &mut [u8]) -> Result<(), NicError> {
        self.nic.read_mr(mr, offset, out)
    }
    fn memory(&self, mr: MrId) -> Result<std::sync::Arc<mwcap::backend::Memory>, NicError> {
        self.nic.memory(mr)
    }
    fn alloc_mw(&self) -> Result<MwInfo, NicError> {
        self.count(self.nic.alloc_mw())
    }
    fn dealloc_mw(&self, mw: MwId) -> Result<(), NicError> {
        self.nic.dealloc_mw(mw)
    }
    fn new_pd(&self) -> Result<Counting, NicError> {
        Ok(Counting { nic: self.nic.new_pd()?, created: self.created.clone() })
    }
    fn same_pd(&self) -> Result<Counting, NicError> {
        Ok(Counting { nic: self.nic.same_pd()?, created: self.created.clone() })
    }
    fn new_pd_boxed(&self) -> Result<Box<dyn Nic>, NicError> {
        Ok(Box::new(self.new_pd()?))
    }
    fn create_cq(&self, depth: u32) -> Result<CqId, NicError> {
        self.count(self.nic.create_cq(depth))
    }
    fn destroy_cq(&self, cq: CqId) -> Result<(), NicError> {
        self.nic.destroy_cq(cq)
    }
    fn create_qp(&self, cfg: QpConfig) -> Result<QpEndpoint, NicError> {
        self.count(self.nic.create_qp(cfg))
    }
    fn connect_qp(&self, qp: QpId, remote: &QpEndpoint) -> Result<(), NicError> {
        self.nic.connect_qp(qp, remote)
    }
    fn set_qp_error(&self, qp: QpId) -> Result<(), NicError> {
        self.nic.set_qp_error(qp)
    }
    fn qp_state(&self, qp: QpId) -> Result<QpState, NicError> {
        self.nic.qp_state(qp)
    }
    fn destroy_qp(&self, qp: QpId) -> Result<(), NicError> {
        self.nic.destroy_qp(qp)
    }
    fn post_send(&self, qp: QpId, wrs: &[SendWr]) -> Result<(), NicError> {
        self.nic.post_send(qp, wrs)
    }
    fn post_recv(&self, qp: QpId, wr_id: u64, sge: Sge) -> Result<(), NicError> {
        self.nic.post_recv(qp, wr_id, sge)
    }
    fn create_srq(&self, max_wr: u32) -> Result<SrqId, NicError> {
        self.nic.create_srq(max_wr)
    }
    fn destroy_srq(&self, srq: SrqId) -> Result<(), NicError> {
        self.nic.destroy_srq(srq)
    }
    fn post_srq_recv(&self, srq: SrqId, wr_id: u64, sge: Sge) -> Result<(), NicError> {
        self.nic.post_srq_recv(srq, wr_id, sge)
    }
    fn arm_srq_limit(&self, srq: SrqId, limit: u32) -> Result<(), NicError> {
        self.nic.arm_srq_limit(srq, limit)
    }
    fn take_srq_limit(&self, srq: SrqId) -> Result<bool, NicError> {
        self.nic.take_srq_limit(srq)
    }
    fn poll_cq(&self, cq: CqId, out: &mut [Completion]) -> Result<usize, NicError> {
        self.nic.poll_cq(cq, out)
    }
    fn poll_cq_ready(&self, cq: CqId, cx: &mut Context<'_>) -> Poll<Result<(), NicError>> {
        self.nic.poll_cq_ready(cq, cx)
    }
}

fn key(text: &str) -> Auth {
    Auth::Key(Key::from_bytes(text.as_bytes().to_vec()).unwrap())
}

fn any_port() -> SocketAddr {
    "127.0.0.1:0".parse().unwrap()
}

/// The endpoint, its driver spawned on `pool`.
fn driven(
    pool: &LocalPool,
    (ep, driver): (Endpoint<Counting>, EndpointDriver<Counting>),
) -> Endpoint<Counting> {
    pool.spawner()
        .spawn_local(async move {
            driver.run().await;
        })
        .unwrap();
    ep
}

/// Each accept's outcome (the connection's policies) and the count of
/// objects created after it.
type Accepts = Vec<(Result<Policies, SetupError>, usize)>;

/// A thread that builds a listening endpoint on `nic` (the key `auth`, the
/// policy `choice`), reports its address and what it created for itself,
/// then runs `accepts` accepts and returns their outcomes (the policies of
/// each connection) with the count of created objects after each.
fn server(
    nic: Counting,
    auth: Auth,
    choice: PolicyChoice,
    probes: ProbeCache,
    accepts: usize,
) -> (SocketAddr, usize, std::thread::JoinHandle<Accepts>) {
    let (tx, rx) = std::sync::mpsc::channel();
    let thread = std::thread::spawn(move || {
        let mut pool = LocalPool::new();
        let built = Endpoint::builder(nic.clone(), auth)
            .policy(choice)
            .probe_cache(probes)
            .handshake_timeout(T)
            .listen(any_port())
            .build()
            .unwrap();
        let endpoint = driven(&pool, built);
        tx.send((endpoint.local_addr().unwrap(), nic.created())).unwrap();
        pool.run_until(async {
            let mut out = Vec::new();
            for _ in 0..accepts {
                let r = endpoint.accept().await.map(|c| c.policies());
                out.push((r, nic.created()));
            }
            out
        })
    });
    let (addr, own) = rx.recv().unwrap();
    (addr, own, thread)
}

#[test]
fn the_server_creates_nothing_before_the_client_proved_the_key() {
    let fabric = Fabric::with_seed(3);
    let server_nic = Counting::new(fabric.add_device(DeviceConfig::spec().named("server")));
    let k = key("the server's key for setup_auth");
    // `auto`: the probe's throw-away queue pairs count too; the endpoint
    // runs it once, as it is built, not for a client.
    let probes = ProbeCache::new();
    let (addr, own, server) = server(server_nic.clone(), k, PolicyChoice::Auto, probes.clone(), 1);
    assert_eq!(probes.probes_run(), 1, "the listening endpoint probed as it was built");
    assert!(own > 0, "the counter sees the endpoint's queue and its probe");

    // A client that stops half way: the server has answered its init and
    // waits for its proof.
    let mut s = TcpStream::connect(addr).unwrap();
    let init = AuthFrame::Init { mode: AuthMode::PreSharedKey, nonce: [4; NONCE_LEN] };
    s.write_all(&encode_auth(&init)).unwrap();
    let mut buf = [0u8; HEADER_LEN + AUTH_HELLO_BODY_LEN];
    s.read_exact(&mut buf).unwrap();
    assert!(matches!(decode_auth(&buf), Ok(AuthFrame::Challenge { .. })));
    assert_eq!(server_nic.created(), own, "nothing exists for a client that has not proved the key");

    // Then a proof it cannot have made without the key.
    s.write_all(&encode_auth(&AuthFrame::Proof([0x5a; MAC_LEN]))).unwrap();
    let mut reject = [0u8; HEADER_LEN + 1];
    s.read_exact(&mut reject).unwrap();
    assert_eq!(decode_auth(&reject), Ok(AuthFrame::Reject(RejectReason::BadProof)));
    let (e, after) = server.join().unwrap().pop().unwrap();
    let e = e.expect_err("the server refuses the client");
    assert!(matches!(e, SetupError::Bootstrap(BootstrapError::AuthFailed { .. })), "{e:?}");
    assert_eq!(after, own, "nor after it failed");
    assert_eq!(server_nic.created(), own);
    assert_eq!(probes.probes_run(), 1, "no probe for the client");
}

#[test]
fn a_wrong_key_costs_neither_side_a_queue_pair_and_the_right_one_does() {
    let fabric = Fabric::with_seed(4);
    let server_nic = Counting::new(fabric.add_device(DeviceConfig::spec().named("server")));
    let client_nic = Counting::new(fabric.add_device(DeviceConfig::spec().named("client")));
    let right = key("the right key, sixteen+");
    let (addr, server_own, server) =
        server(server_nic.clone(), right.clone(), PolicyChoice::Confirm, ProbeCache::new(), 2);
    // `confirm`: the client runs no probe, so all it creates for a
    // connection comes after the server's proof.
    let mut pool = LocalPool::new();
    let client = |auth: Auth| {
        let built = Endpoint::builder(client_nic.clone(), auth)
            .policy(PolicyChoice::Confirm)
            .handshake_timeout(T)
            .build()
            .unwrap();
        driven(&pool, built)
    };
    let (wrong, good) = (client(key("a wrong key, sixteen+")), client(right));
    let client_own = client_nic.created();
    let e = pool.run_until(wrong.connect(addr)).err().expect("a wrong key is refused");
    assert!(matches!(e, SetupError::Bootstrap(BootstrapError::AuthRejected { .. })), "{e:?}");
    assert_eq!(client_nic.created(), client_own, "the client created nothing for a server that refused it");

    let c = pool.run_until(good.connect(addr)).expect("the right key connects");
    let mut outcomes = server.join().unwrap().into_iter();
    let (first, after_first) = outcomes.next().unwrap();
    assert!(matches!(first, Err(SetupError::Bootstrap(BootstrapError::AuthFailed { .. }))), "{first:?}");
    assert_eq!(after_first, server_own);
    let (second, after_second) = outcomes.next().unwrap();
    let s = second.expect("the server connects the client with the key");
    let want = Policies::both(Policy::Confirm);
    assert_eq!((c.policies(), s), (want, want));
    // The counter does see what a connection creates (a QP, regions).
    assert!(after_second >= server_own + 3, "{after_second} after {server_own}");
    assert!(client_nic.created() >= client_own + 3, "{} after {client_own}", client_nic.created());
}
