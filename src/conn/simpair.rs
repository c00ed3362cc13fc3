//! Two endpoints on the simulated fabric with one virtual clock: the
//! deterministic harness for mwcap's own tests and for users testing their
//! services (quinn-proto's `Pair`, smoltcp's netsim).

use std::time::Duration;

use super::{Config, Event, Link, Policies, Role, SetupError};
use crate::sim::{DeviceConfig, DeviceId, Fabric, FabricConfig, Progress, QpAddr, SimNic};

/// A client and a server endpoint, each on its own simulated device,
/// connected, on a fabric in manual progress mode.
///
/// It drives the links and nothing more: a side that goes down keeps its
/// QP until the test destroys it (`Link::finish_close`, once
/// [`Connection::flushed`](super::proto::Connection::flushed)), as an
/// endpoint's driver does by itself; its buffers exposed through windows
/// come back only then.
pub struct SimPair {
    /// The fabric (faults, oracle).
    pub fabric: Fabric,
    /// The client endpoint.
    pub client: Link<SimNic>,
    /// The server endpoint.
    pub server: Link<SimNic>,
    /// Events the client produced, in order, not yet taken.
    pub client_events: Vec<Event>,
    /// Events the server produced, in order, not yet taken.
    pub server_events: Vec<Event>,
}

impl SimPair {
    /// Build the pair: `fabric` (its progress mode is set to manual), a
    /// device for each side, the `policies` of the two directions, and each
    /// side's settings.
    pub fn new(
        fabric: FabricConfig,
        client_dev: DeviceConfig,
        server_dev: DeviceConfig,
        policies: Policies,
        client: Config,
        server: Config,
    ) -> Result<SimPair, SetupError> {
        let fabric = Fabric::new(FabricConfig { progress: Progress::Manual, ..fabric });
        let cn = fabric.add_device(client_dev.named("client"));
        let sn = fabric.add_device(server_dev.named("server"));
        let mut client = Link::new(cn, Role::Client, policies, client)?;
        let mut server = Link::new(sn, Role::Server, policies, server)?;
        let (c, s) = (client.local(), server.local());
        client.connect(&s)?;
        server.connect(&c)?;
        Ok(SimPair { fabric, client, server, client_events: Vec::new(), server_events: Vec::new() })
    }

    /// [`SimPair::new`] with spec-following devices on a fabric seeded
    /// `seed` (no faults): the usual start of a test.
    pub fn spec(
        seed: u64,
        policies: Policies,
        client: Config,
        server: Config,
    ) -> Result<SimPair, SetupError> {
        SimPair::new(
            FabricConfig::with_seed(seed),
            DeviceConfig::spec(),
            DeviceConfig::spec(),
            policies,
            client,
            server,
        )
    }

    /// The virtual time.
    pub fn now(&self) -> Duration {
        self.fabric.now()
    }

    /// The client's QP, as the oracle names it.
    pub fn client_qp(&self) -> QpAddr {
        QpAddr { device: self.client.nic().device(), qpn: self.client.local().qpn }
    }

    /// The server's QP, as the oracle names it.
    pub fn server_qp(&self) -> QpAddr {
        QpAddr { device: self.server.nic().device(), qpn: self.server.local().qpn }
    }

    /// The client's device.
    pub fn client_device(&self) -> DeviceId {
        self.client.nic().device()
    }

    /// The server's device.
    pub fn server_device(&self) -> DeviceId {
        self.server.nic().device()
    }

    /// Let both endpoints take in everything that is due now.
    pub fn settle(&mut self) {
        let now = self.now();
        for _ in 0..1000 {
            self.fabric.run_until(now);
            self.client.handle_timeout(now);
            self.server.handle_timeout(now);
            self.client.drive(now);
            self.server.drive(now);
            let mut any = false;
            while let Some(e) = self.client.poll_event() {
                self.client_events.push(e);
                any = true;
            }
            while let Some(e) = self.server.poll_event() {
                self.server_events.push(e);
                any = true;
            }
            let due = self.fabric.next_event_at().is_some_and(|t| t <= now);
            if !any && !due {
                break;
            }
        }
    }

    /// The next instant anything happens: a fabric event or an endpoint timer.
    pub fn next_wakeup(&self) -> Option<Duration> {
        [self.fabric.next_event_at(), self.client.poll_timeout(), self.server.poll_timeout()]
            .into_iter()
            .flatten()
            .min()
    }

    /// Move to the next wakeup (no later than `limit`) and settle. Returns
    /// false when nothing is pending before `limit`.
    pub fn step(&mut self, limit: Duration) -> bool {
        self.settle();
        match self.next_wakeup() {
            // A wakeup at or before now was just handled by settle(): nothing is pending.
            Some(t) if t <= self.now() => false,
            Some(t) if t <= limit => {
                self.fabric.run_until(t);
                self.settle();
                true
            }
            _ => false,
        }
    }

    /// Step until `pred` holds or `limit` of virtual time passed; returns `pred`'s last value.
    pub fn drive_until(&mut self, limit: Duration, mut pred: impl FnMut(&mut SimPair) -> bool) -> bool {
        let end = self.now() + limit;
        loop {
            self.settle();
            if pred(self) {
                return true;
            }
            if !self.step(end) {
                if self.now() < end {
                    self.fabric.run_until(end);
                    self.settle();
                }
                return pred(self);
            }
        }
    }

    /// Step through `d` of virtual time.
    pub fn run_for(&mut self, d: Duration) {
        let end = self.now() + d;
        while self.step(end) {}
        if self.now() < end {
            self.fabric.run_until(end);
        }
        self.settle();
    }
}
