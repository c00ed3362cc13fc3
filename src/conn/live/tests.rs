use super::*;
use crate::conn::{Config, Policies, Policy, Role};
use crate::sim::{DeviceConfig, Fabric};

fn client() -> Connection<crate::sim::SimNic> {
    let fabric = Fabric::with_seed(1);
    let nic = fabric.add_device(DeviceConfig::spec());
    let hub = crate::conn::hub::Hub::new(nic, 1024, None, None, false, std::time::Duration::ZERO).unwrap();
    let policies = Policies::both(Policy::Mw);
    let link = hub.prepare(hub.connection_nic().unwrap(), Role::Server, Config::default()).unwrap();
    hub.add(link.finish(policies).unwrap(), None)
}

#[test]
fn polling_next_request_again_does_not_pile_up_wakers() {
    let conn = client();
    let waker = futures::task::noop_waker();
    let mut cx = Context::from_waker(&waker);
    let fut = conn.next_request();
    futures::pin_mut!(fut);
    for _ in 0..100 {
        assert!(fut.as_mut().poll(&mut cx).is_pending());
    }
    assert_eq!(conn.peek(|s| s.request_waiters.0.len()), 1);
}

#[test]
fn yield_now_returns_pending_once_and_wakes_itself() {
    let woke = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    struct Count(Arc<std::sync::atomic::AtomicUsize>);
    impl futures::task::ArcWake for Count {
        fn wake_by_ref(a: &Arc<Self>) {
            a.0.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        }
    }
    let waker = futures::task::waker(Arc::new(Count(woke.clone())));
    let mut cx = Context::from_waker(&waker);
    let mut y = driver::yield_now();
    assert!(Pin::new(&mut y).poll(&mut cx).is_pending());
    assert_eq!(woke.load(std::sync::atomic::Ordering::SeqCst), 1);
    assert!(Pin::new(&mut y).poll(&mut cx).is_ready());
}

/// A client makes its call results' slots with the connection (a slot per
/// buffer, at least 64), so its first burst of calls allocates none; a
/// server makes none.
#[test]
fn a_client_has_a_result_slot_per_buffer_before_its_first_call() {
    let fabric = Fabric::with_seed(2);
    let nic = fabric.add_device(DeviceConfig::spec());
    let hub = crate::conn::hub::Hub::new(nic, 8192, None, None, false, std::time::Duration::ZERO).unwrap();
    let make = |role, buffers| {
        let cfg = Config { buffers, ..Config::default() };
        let link = hub.prepare(hub.connection_nic().unwrap(), role, cfg).unwrap();
        hub.add(link.finish(Policies::both(Policy::Mw)).unwrap(), None)
    };
    let spare =
        |c: &Connection<crate::sim::SimNic>| c.peek(|s| (s.spare_slots.len(), s.spare_slots.capacity()));
    assert_eq!(spare(&make(Role::Client, 16)), (64, 64));
    assert_eq!(spare(&make(Role::Client, 100)), (100, 100));
    assert_eq!(spare(&make(Role::Server, 100)), (0, 64));
}
