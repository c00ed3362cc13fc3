//! Small conversions between libibverbs' C values and mwcap's types.
//!
//! Nothing here dereferences a pointer; the few `unsafe` calls are plain
//! libc functions with owned arguments.

use std::ffi::CStr;

use rdma_mummy_sys as sys;
use sys::{ibv_mtu, ibv_qp_state, ibv_wc_opcode, ibv_wc_status};

use crate::backend::{NicError, OsError, QpState, WcOpcode, WcStatus};

/// The calling thread's `errno`.
pub(crate) fn errno() -> i32 {
    std::io::Error::last_os_error().raw_os_error().unwrap_or(0)
}

/// A [`NicError`] for a failed call that reported its error through `errno`
/// (a NULL return, or -1).
pub(crate) fn last_error(op: &'static str) -> NicError {
    from_errno(op, errno())
}

/// A [`NicError`] for an errno value, mapping "not supported" to
/// [`NicError::Unsupported`].
pub(crate) fn from_errno(op: &'static str, errno: i32) -> NicError {
    // Some providers return a zero errno after a NULL; say something useful.
    let errno = if errno == 0 { libc::EIO } else { errno };
    if errno == libc::EOPNOTSUPP || errno == libc::ENOSYS {
        NicError::Unsupported { op, detail: OsError::from_errno(errno).to_string() }
    } else {
        NicError::Os { op, source: OsError::from_errno(errno) }
    }
}

/// Turn a libibverbs return code (0, or an errno, or -1 with `errno` set) into a result.
pub(crate) fn check(op: &'static str, rc: i32) -> Result<(), NicError> {
    match rc {
        0 => Ok(()),
        -1 => Err(last_error(op)),
        e if e < 0 => Err(from_errno(op, -e)),
        e => Err(from_errno(op, e)),
    }
}

/// Whether `libibverbs.so.1` can be loaded, and if not, the loader's message.
pub(crate) fn probe_library() -> Result<(), String> {
    const NAME: &CStr = c"libibverbs.so.1";
    // SAFETY: NAME is a NUL-terminated string that outlives the call; dlopen
    // has no other preconditions. The library is already loaded by
    // rdma-mummy-sys' constructor when it exists, so this only bumps its
    // reference count.
    let handle = unsafe { libc::dlopen(NAME.as_ptr(), libc::RTLD_LAZY | libc::RTLD_LOCAL) };
    if handle.is_null() {
        // SAFETY: dlerror returns NULL or a NUL-terminated string valid until
        // the next dl* call on this thread; it is copied before any such call.
        let msg = unsafe { libc::dlerror() };
        let text = if msg.is_null() {
            "unknown dlopen error".to_string()
        } else {
            // SAFETY: see above: msg is a valid C string for now.
            unsafe { CStr::from_ptr(msg) }.to_string_lossy().into_owned()
        };
        return Err(text);
    }
    // SAFETY: handle came from a successful dlopen and is closed exactly once.
    unsafe { libc::dlclose(handle) };
    Ok(())
}

/// `ibv_wc_status` to [`WcStatus`].
pub(crate) fn wc_status(raw: ibv_wc_status::Type) -> WcStatus {
    use ibv_wc_status::*;
    match raw {
        IBV_WC_SUCCESS => WcStatus::Success,
        IBV_WC_LOC_LEN_ERR => WcStatus::LocLenErr,
        IBV_WC_LOC_QP_OP_ERR => WcStatus::LocQpOpErr,
        IBV_WC_LOC_PROT_ERR => WcStatus::LocProtErr,
        IBV_WC_WR_FLUSH_ERR => WcStatus::WrFlushErr,
        IBV_WC_MW_BIND_ERR => WcStatus::MwBindErr,
        IBV_WC_REM_INV_REQ_ERR => WcStatus::RemInvReqErr,
        IBV_WC_REM_ACCESS_ERR => WcStatus::RemAccessErr,
        IBV_WC_REM_OP_ERR => WcStatus::RemOpErr,
        IBV_WC_RETRY_EXC_ERR => WcStatus::RetryExcErr,
        IBV_WC_RNR_RETRY_EXC_ERR => WcStatus::RnrRetryExcErr,
        other => WcStatus::Other(other),
    }
}

/// `ibv_wc_opcode` to [`WcOpcode`].
pub(crate) fn wc_opcode(raw: ibv_wc_opcode::Type) -> WcOpcode {
    use ibv_wc_opcode::*;
    match raw {
        IBV_WC_SEND => WcOpcode::Send,
        IBV_WC_RDMA_READ => WcOpcode::RdmaRead,
        IBV_WC_RDMA_WRITE => WcOpcode::RdmaWrite,
        IBV_WC_BIND_MW => WcOpcode::BindMw,
        IBV_WC_LOCAL_INV => WcOpcode::LocalInv,
        IBV_WC_RECV => WcOpcode::Recv,
        other => WcOpcode::Other(other),
    }
}

/// `ibv_qp_state` to [`QpState`]; `None` for `IBV_QPS_UNKNOWN`.
pub(crate) fn qp_state(raw: ibv_qp_state::Type) -> Option<QpState> {
    use ibv_qp_state::*;
    Some(match raw {
        IBV_QPS_RESET => QpState::Reset,
        IBV_QPS_INIT => QpState::Init,
        IBV_QPS_RTR => QpState::Rtr,
        IBV_QPS_RTS => QpState::Rts,
        IBV_QPS_SQD => QpState::Sqd,
        IBV_QPS_SQE => QpState::Sqe,
        IBV_QPS_ERR => QpState::Err,
        _ => return None,
    })
}

/// `ibv_mtu` to bytes (0 for an unknown value).
pub(crate) fn mtu_bytes(raw: ibv_mtu::Type) -> u32 {
    match raw {
        ibv_mtu::IBV_MTU_256 => 256,
        ibv_mtu::IBV_MTU_512 => 512,
        ibv_mtu::IBV_MTU_1024 => 1024,
        ibv_mtu::IBV_MTU_2048 => 2048,
        ibv_mtu::IBV_MTU_4096 => 4096,
        _ => 0,
    }
}

/// The largest `ibv_mtu` not above `bytes` (at least 256).
pub(crate) fn mtu_enum(bytes: u32) -> ibv_mtu::Type {
    match bytes {
        4096.. => ibv_mtu::IBV_MTU_4096,
        2048..=4095 => ibv_mtu::IBV_MTU_2048,
        1024..=2047 => ibv_mtu::IBV_MTU_1024,
        512..=1023 => ibv_mtu::IBV_MTU_512,
        _ => ibv_mtu::IBV_MTU_256,
    }
}

/// Copy a fixed-size C string field (`char name[64]`) into a `String`.
pub(crate) fn c_chars(field: &[std::os::raw::c_char]) -> String {
    let bytes: Vec<u8> = field.iter().take_while(|&&c| c != 0).map(|&c| c as u8).collect();
    String::from_utf8_lossy(&bytes).into_owned()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn mtu_round_trips() {
        for b in [256, 512, 1024, 2048, 4096] {
            assert_eq!(mtu_bytes(mtu_enum(b)), b);
        }
        assert_eq!(mtu_bytes(mtu_enum(1500)), 1024);
        assert_eq!(mtu_bytes(mtu_enum(9000)), 4096);
        assert_eq!(mtu_bytes(mtu_enum(0)), 256);
    }

    #[test]
    fn errno_mapping_separates_unsupported() {
        assert!(matches!(check("x", libc::EOPNOTSUPP), Err(NicError::Unsupported { .. })));
        assert!(matches!(check("x", -libc::EINVAL), Err(NicError::Os { .. })));
        assert_eq!(check("x", 0), Ok(()));
    }
}
