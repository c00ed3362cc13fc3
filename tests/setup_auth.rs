//! `conn::accept` creates nothing for a client before it proved the key:
//! every NIC object (queue pair, completion queue, region, window, the
//! probe's throw-away pair included) is counted as it is created on a
//! simulated NIC, while a client stops half way through the auth phase,
//! after it failed, and, for contrast, after a client that has the key.

use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use mwcap::backend::*;
use mwcap::bootstrap::{
    decode_auth, encode_auth, Auth, AuthFrame, AuthMode, BootstrapError, Key, RejectReason,
    AUTH_HELLO_BODY_LEN, HEADER_LEN, MAC_LEN, NONCE_LEN,
};
use mwcap::conn::{accept, connect, Config, Policies, Policy, PolicyChoice, Role, SetupError};
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

impl Nic for Counting {
    fn device_info(&self) -> DeviceInfo {
        self.nic.device_info()
    }
    fn reg_mr(&self, len: usize, access: Access) -> Result<MrInfo, NicError> {
        self.count(self.nic.reg_mr(len, access))
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
    fn with_mr(&self, mr: MrId, offset: usize, len: usize, f: &mut dyn FnMut(&[u8])) -> Result<(), NicError> {
        self.nic.with_mr(mr, offset, len, f)
    }
    fn with_mr_mut(
        &self,
        mr: MrId,
        offset: usize,
        len: usize,
        f: &mut dyn FnMut(&mut [u8]),
    ) -> Result<(), NicError> {
        self.nic.with_mr_mut(mr, offset, len, f)
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

fn server_cfg() -> Config {
    Config::new(Role::Server, Policies::both(Policy::Mw))
}

fn client_cfg() -> Config {
    Config::new(Role::Client, Policies::both(Policy::Mw))
}

#[test]
fn the_server_creates_nothing_before_the_client_proved_the_key() {
    let fabric = Fabric::with_seed(3);
    let server_nic = Counting::new(fabric.add_device(DeviceConfig::spec().named("server")));
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = listener.local_addr().unwrap();
    let k = key("the server's key for setup_auth");
    let (nic, k2) = (server_nic.clone(), k.clone());
    // `auto`: the probe's throw-away queue pairs count too.
    let server = std::thread::spawn(move || accept(nic, &listener, server_cfg(), PolicyChoice::Auto, &k2, T));

    // A client that stops half way: the server has answered its init and
    // waits for its proof.
    let mut s = TcpStream::connect(addr).unwrap();
    let init = AuthFrame::Init { mode: AuthMode::PreSharedKey, nonce: [4; NONCE_LEN] };
    s.write_all(&encode_auth(&init)).unwrap();
    let mut buf = [0u8; HEADER_LEN + AUTH_HELLO_BODY_LEN];
    s.read_exact(&mut buf).unwrap();
    assert!(matches!(decode_auth(&buf), Ok(AuthFrame::Challenge { .. })));
    assert_eq!(server_nic.created(), 0, "nothing exists for a client that has not proved the key");

    // Then a proof it cannot have made without the key.
    s.write_all(&encode_auth(&AuthFrame::Proof([0x5a; MAC_LEN]))).unwrap();
    let mut reject = [0u8; HEADER_LEN + 1];
    s.read_exact(&mut reject).unwrap();
    assert_eq!(decode_auth(&reject), Ok(AuthFrame::Reject(RejectReason::BadProof)));
    let e = server.join().unwrap().err().expect("the server refuses the client");
    assert!(matches!(e, SetupError::Bootstrap(BootstrapError::AuthFailed { .. })), "{e:?}");
    assert_eq!(server_nic.created(), 0, "nor after it failed");
}

#[test]
fn a_wrong_key_costs_neither_side_a_queue_pair_and_the_right_one_does() {
    let fabric = Fabric::with_seed(4);
    let server_nic = Counting::new(fabric.add_device(DeviceConfig::spec().named("server")));
    let client_nic = Counting::new(fabric.add_device(DeviceConfig::spec().named("client")));
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = listener.local_addr().unwrap();
    let (nic, k) = (server_nic.clone(), key("the right key, sixteen+"));
    let server = std::thread::spawn(move || {
        let first = accept(nic.clone(), &listener, server_cfg(), PolicyChoice::Confirm, &k, T);
        let after_first = nic.created();
        let second = accept(nic, &listener, server_cfg(), PolicyChoice::Confirm, &k, T);
        (first.err(), after_first, second)
    });
    // `confirm`: the client runs no probe, so all it creates comes after the server's proof.
    let cfg = client_cfg();
    let e = connect(client_nic.clone(), addr, cfg, PolicyChoice::Confirm, &key("a wrong key, sixteen+"), T)
        .err()
        .expect("a wrong key is refused");
    assert!(matches!(e, SetupError::Bootstrap(BootstrapError::AuthRejected { .. })), "{e:?}");
    assert_eq!(client_nic.created(), 0, "the client created nothing for a server that refused it");

    let c = connect(
        client_nic.clone(),
        addr,
        client_cfg(),
        PolicyChoice::Confirm,
        &key("the right key, sixteen+"),
        T,
    )
    .expect("the right key connects");
    let (first, after_first, second) = server.join().unwrap();
    assert!(matches!(first, Some(SetupError::Bootstrap(BootstrapError::AuthFailed { .. }))), "{first:?}");
    assert_eq!(after_first, 0);
    let s = second.expect("the server connects the client with the key");
    assert_eq!((c.policies, s.policies), (Policies::both(Policy::Confirm), Policies::both(Policy::Confirm)));
    // The counter does see what a connection creates (a QP, a CQ, regions).
    assert!(server_nic.created() >= 3 && client_nic.created() >= 3);
}
