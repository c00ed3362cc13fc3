//! Device list, device context, and device/port/GID queries.

use std::ptr::NonNull;
use std::sync::Arc;

use rdma_mummy_sys as sys;
use sys::{ibv_context, ibv_device, ibv_device_cap_flags, ibv_port_state};

use super::error::OpenError;
use super::event::AsyncEvents;
use super::sys::{c_chars, check, last_error, mtu_bytes, probe_library};
use crate::backend::{DeviceInfo, NicError};

/// An open device: `struct ibv_context`. Every other verbs object keeps its
/// context alive through an `Arc`.
pub struct Context {
    ptr: NonNull<ibv_context>,
    name: String,
    /// The asynchronous-event state: the SRQ limit flags, and the lock
    /// that serialises reading `async_fd` (see the `event` module).
    events: AsyncEvents,
}

// SAFETY: libibverbs contexts may be used from any thread, concurrently
// (libibverbs documents all verbs as thread-safe); `Context`'s Rust state is
// the immutable name and the event state, which is behind a mutex.
unsafe impl Send for Context {}
// SAFETY: as above; every method takes `&self` and only calls thread-safe verbs.
unsafe impl Sync for Context {}

/// A device's name and what it claims, as listed by [`list_devices`].
#[derive(Clone, Debug)]
pub struct ListedDevice {
    /// The device name (`rxe0`, `mlx5_0`).
    pub name: String,
    /// Its attributes at port 1, or why they could not be read.
    pub info: Result<DeviceInfo, OpenError>,
}

/// Attributes of a device (a subset of `struct ibv_device_attr`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct DeviceAttrs {
    /// `IBV_DEVICE_MEM_WINDOW`.
    pub mem_window: bool,
    /// `IBV_DEVICE_MEM_WINDOW_TYPE_2A`.
    pub mw_type_2a: bool,
    /// `IBV_DEVICE_MEM_WINDOW_TYPE_2B`.
    pub mw_type_2b: bool,
    /// Maximum number of memory windows.
    pub max_mw: u32,
    /// Maximum scatter entries per work request.
    pub max_sge: u32,
    /// Maximum outstanding READs per QP as responder.
    pub max_qp_rd_atom: u32,
    /// Maximum outstanding READs per QP as requester.
    pub max_qp_init_rd_atom: u32,
    /// Maximum work requests per queue.
    pub max_qp_wr: u32,
    /// Maximum completion queue entries.
    pub max_cqe: u32,
    /// Maximum work requests per shared receive queue (0: no SRQs).
    pub max_srq_wr: u32,
    /// Number of physical ports.
    pub phys_port_cnt: u8,
}

/// Attributes of a port (a subset of `struct ibv_port_attr`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PortAttrs {
    /// Whether the port is `IBV_PORT_ACTIVE`.
    pub active: bool,
    /// The raw `ibv_port_state`.
    pub state: u32,
    /// Active MTU in bytes.
    pub active_mtu: u32,
    /// The port's LID (0 on RoCE).
    pub lid: u16,
    /// Number of GID table entries.
    pub gid_tbl_len: u32,
    /// `IBV_LINK_LAYER_*` (1 InfiniBand, 2 Ethernet).
    pub link_layer: u8,
}

/// The device list, freed on drop.
struct DeviceList {
    ptr: NonNull<*mut ibv_device>,
    len: usize,
}

impl DeviceList {
    fn get() -> Result<DeviceList, OpenError> {
        probe_library().map_err(|detail| OpenError::LibraryMissing { detail })?;
        let mut n: std::os::raw::c_int = 0;
        // SAFETY: `n` is a valid out-pointer for the duration of the call.
        let raw = unsafe { sys::ibv_get_device_list(&mut n) };
        let ptr = NonNull::new(raw).ok_or_else(|| last_error("ibv_get_device_list"))?;
        Ok(DeviceList { ptr, len: usize::try_from(n).unwrap_or(0) })
    }

    fn devices(&self) -> impl Iterator<Item = NonNull<ibv_device>> + '_ {
        (0..self.len).filter_map(move |i| {
            // SAFETY: libibverbs returned an array of `len` device pointers
            // (NULL-terminated), valid until the list is freed in `drop`,
            // which cannot happen while `self` is borrowed.
            NonNull::new(unsafe { *self.ptr.as_ptr().add(i) })
        })
    }

    fn name(dev: NonNull<ibv_device>) -> String {
        // SAFETY: `dev` is an element of a live device list; `name` is a
        // fixed-size, NUL-terminated array inside it.
        c_chars(unsafe { &(*dev.as_ptr()).name })
    }
}

impl Drop for DeviceList {
    fn drop(&mut self) {
        // SAFETY: the list came from ibv_get_device_list and is freed once;
        // contexts opened from it stay valid after the free (libibverbs
        // documents this).
        unsafe { sys::ibv_free_device_list(self.ptr.as_ptr()) };
    }
}

/// List the devices with what they claim about themselves (port 1).
pub fn list_devices() -> Result<Vec<ListedDevice>, OpenError> {
    let list = DeviceList::get()?;
    let names: Vec<String> = list.devices().map(DeviceList::name).collect();
    drop(list);
    Ok(names
        .into_iter()
        .map(|name| {
            let info = Context::open(Some(&name)).and_then(|ctx| ctx.device_info(1));
            ListedDevice { name, info }
        })
        .collect())
}

impl Context {
    /// Open the named device, or the first one when `name` is `None`.
    pub fn open(name: Option<&str>) -> Result<Arc<Context>, OpenError> {
        let list = DeviceList::get()?;
        let mut chosen = None;
        let mut names = Vec::new();
        for dev in list.devices() {
            let dev_name = DeviceList::name(dev);
            if chosen.is_none() && name.map_or(true, |n| n == dev_name) {
                chosen = Some((dev, dev_name.clone()));
            }
            names.push(dev_name);
        }
        let (dev, dev_name) = match (chosen, name) {
            (Some(c), _) => c,
            (None, _) if names.is_empty() => return Err(OpenError::NoDevices),
            (None, n) => {
                return Err(OpenError::NoSuchDevice {
                    name: n.unwrap_or_default().to_string(),
                    available: names.join(", "),
                })
            }
        };
        // SAFETY: `dev` belongs to the live list `list`.
        let raw = unsafe { sys::ibv_open_device(dev.as_ptr()) };
        let ptr = NonNull::new(raw).ok_or_else(|| last_error("ibv_open_device"))?;
        Ok(Arc::new(Context { ptr, name: dev_name, events: AsyncEvents::new() }))
    }

    /// The device name.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// The raw context, for the other verbs types.
    pub(crate) fn as_ptr(&self) -> *mut ibv_context {
        self.ptr.as_ptr()
    }

    /// The asynchronous-event state (the `event` module).
    pub(super) fn async_events(&self) -> &AsyncEvents {
        &self.events
    }

    /// The descriptor libibverbs reads asynchronous events from.
    pub(super) fn async_fd(&self) -> i32 {
        // SAFETY: the context is open while `self` lives; `async_fd` is set
        // when it is opened and never changes.
        unsafe { (*self.as_ptr()).async_fd }
    }

    /// Query the device attributes.
    pub fn query_device(&self) -> Result<DeviceAttrs, NicError> {
        // SAFETY: ibv_device_attr is a C struct of integers and char arrays,
        // for which all-zero bytes are a valid value.
        let mut attr: sys::ibv_device_attr = unsafe { std::mem::zeroed() };
        // SAFETY: the context is open (we own it) and `attr` is a valid,
        // writable ibv_device_attr for the duration of the call.
        check("ibv_query_device", unsafe { sys::ibv_query_device(self.as_ptr(), &mut attr) })?;
        let flags = attr.device_cap_flags;
        let has = |f: ibv_device_cap_flags| flags & f.0 == f.0;
        let nonneg = |v: i32| u32::try_from(v).unwrap_or(0);
        Ok(DeviceAttrs {
            mem_window: has(ibv_device_cap_flags::IBV_DEVICE_MEM_WINDOW),
            mw_type_2a: has(ibv_device_cap_flags::IBV_DEVICE_MEM_WINDOW_TYPE_2A),
            mw_type_2b: has(ibv_device_cap_flags::IBV_DEVICE_MEM_WINDOW_TYPE_2B),
            max_mw: nonneg(attr.max_mw),
            max_sge: nonneg(attr.max_sge),
            max_qp_rd_atom: nonneg(attr.max_qp_rd_atom),
            max_qp_init_rd_atom: nonneg(attr.max_qp_init_rd_atom),
            max_qp_wr: nonneg(attr.max_qp_wr),
            max_cqe: nonneg(attr.max_cqe),
            max_srq_wr: if attr.max_srq > 0 { nonneg(attr.max_srq_wr) } else { 0 },
            phys_port_cnt: attr.phys_port_cnt,
        })
    }

    /// Query a port (numbered from 1).
    pub fn query_port(&self, port: u8) -> Result<PortAttrs, NicError> {
        // SAFETY: ibv_port_attr is a C struct of integers; all-zero is valid.
        let mut attr: sys::ibv_port_attr = unsafe { std::mem::zeroed() };
        // SAFETY: the context is open and `attr` is writable; the inline
        // ibv_query_port passes our struct size, and libibverbs writes at most
        // that many bytes (it zero-fills fields it does not know).
        check("ibv_query_port", unsafe { sys::ibv_query_port(self.as_ptr(), port, &mut attr) })?;
        Ok(PortAttrs {
            active: attr.state == ibv_port_state::IBV_PORT_ACTIVE,
            state: attr.state,
            active_mtu: mtu_bytes(attr.active_mtu),
            lid: attr.lid,
            gid_tbl_len: u32::try_from(attr.gid_tbl_len).unwrap_or(0),
            link_layer: attr.link_layer,
        })
    }

    /// Read GID `index` of `port`.
    pub fn query_gid(&self, port: u8, index: u8) -> Result<[u8; 16], NicError> {
        let mut gid = sys::ibv_gid { raw: [0; 16] };
        // SAFETY: the context is open and `gid` is a writable 16-byte union.
        check("ibv_query_gid", unsafe { sys::ibv_query_gid(self.as_ptr(), port, index.into(), &mut gid) })?;
        // SAFETY: every 16-byte pattern is a valid `raw` array; the union was
        // initialised through `raw` and written whole by libibverbs.
        Ok(unsafe { gid.raw })
    }

    /// The kernel driver behind the device (`rxe`, `mlx5_core`…), best effort.
    pub fn driver(&self) -> String {
        let link = format!("/sys/class/infiniband/{}/device/driver", self.name);
        if let Ok(target) = std::fs::read_link(&link) {
            if let Some(base) = target.file_name() {
                return base.to_string_lossy().into_owned();
            }
        }
        // Software devices (rxe, siw) have no bus device: use the name's stem.
        self.name.trim_end_matches(|c: char| c.is_ascii_digit() || c == '_').to_string()
    }

    /// What the device claims, as [`DeviceInfo`], with the MTU of `port`.
    pub fn device_info(&self, port: u8) -> Result<DeviceInfo, OpenError> {
        let a = self.query_device()?;
        let p = self.query_port(port)?;
        Ok(DeviceInfo {
            name: self.name.clone(),
            driver: self.driver(),
            mem_window: a.mem_window,
            mw_type_2a: a.mw_type_2a,
            mw_type_2b: a.mw_type_2b,
            max_mw: a.max_mw,
            max_sge: a.max_sge,
            max_qp_rd_atom: a.max_qp_rd_atom.min(a.max_qp_init_rd_atom),
            mtu: p.active_mtu,
        })
    }
}

impl Drop for Context {
    fn drop(&mut self) {
        // SAFETY: the context was opened by us and is closed once. Every
        // child object holds an Arc to it, so none is alive as a Rust
        // object; one whose teardown failed was leaked and is never touched
        // again (its memory kept). Closing the device has the kernel
        // destroy what is left of it and unpin its pages.
        let rc = unsafe { sys::ibv_close_device(self.as_ptr()) };
        if rc != 0 {
            tracing::warn!(device = %self.name, rc, "ibv_close_device failed");
        }
    }
}

impl std::fmt::Debug for Context {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Context").field("name", &self.name).finish()
    }
}
