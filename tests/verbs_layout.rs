//! Struct layouts declared by hand (in rdma-mummy-sys' `types.rs`) or
//! generated from its vendored headers, checked against the system's
//! `<infiniband/verbs.h>`: a C program (tests/verbs_layout/layout.c) prints
//! `sizeof`/`offsetof` for every struct and field mwcap's verbs layer
//! touches, and each line must equal the Rust `size_of`/`offset_of!`.
//!
//! Needs only a C compiler and the libibverbs headers (libibverbs-dev), no device.
#![cfg(feature = "verbs")]

use std::collections::BTreeMap;
use std::mem::{offset_of, size_of};
use std::path::PathBuf;
use std::process::Command;

use rdma_mummy_sys::*;

/// What the C compiler says, as `name -> value`.
fn c_layout() -> BTreeMap<String, usize> {
    let src = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/verbs_layout/layout.c");
    let exe = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("verbs_layout_c");
    let cc = std::env::var("CC").unwrap_or_else(|_| "cc".into());
    let out = Command::new(&cc)
        .arg("-std=gnu11")
        .arg("-o")
        .arg(&exe)
        .arg(&src)
        .output()
        .unwrap_or_else(|e| panic!("cannot run the C compiler {cc:?}: {e}; install gcc (or set CC)"));
    assert!(
        out.status.success(),
        "compiling {} failed (is libibverbs-dev installed?):\n{}",
        src.display(),
        String::from_utf8_lossy(&out.stderr)
    );
    let run = Command::new(&exe).output().expect("run the layout program");
    assert!(run.status.success(), "layout program failed");
    String::from_utf8(run.stdout)
        .expect("utf-8 output")
        .lines()
        .map(|l| {
            let (k, v) = l.split_once(' ').expect("`name value` lines");
            (k.to_string(), v.parse().expect("a number"))
        })
        .collect()
}

/// What Rust says, under the same names.
fn rust_layout() -> BTreeMap<String, usize> {
    let mut m = BTreeMap::new();
    macro_rules! size {
        ($t:ident) => {
            m.insert(concat!(stringify!($t), ".size").to_string(), size_of::<$t>());
        };
    }
    macro_rules! off {
        ($t:ident . $f:ident) => {
            m.insert(concat!(stringify!($t), ".", stringify!($f)).to_string(), offset_of!($t, $f));
        };
        ($t:ident . $name:literal = $v:expr) => {
            m.insert(concat!(stringify!($t), ".", $name).to_string(), $v);
        };
    }

    size!(ibv_wc);
    off!(ibv_wc.wr_id);
    off!(ibv_wc.status);
    off!(ibv_wc.opcode);
    off!(ibv_wc.vendor_err);
    off!(ibv_wc.byte_len);
    off!(ibv_wc."invalidated_rkey" = offset_of!(ibv_wc, imm_data_invalidated_rkey_union)
        + offset_of!(imm_data_invalidated_rkey_union_t, invalidated_rkey));
    off!(ibv_wc.qp_num);
    off!(ibv_wc.src_qp);
    off!(ibv_wc.wc_flags);
    off!(ibv_wc.pkey_index);
    off!(ibv_wc.slid);
    off!(ibv_wc.sl);
    off!(ibv_wc.dlid_path_bits);

    size!(ibv_send_wr);
    off!(ibv_send_wr.wr_id);
    off!(ibv_send_wr.next);
    off!(ibv_send_wr.sg_list);
    off!(ibv_send_wr.num_sge);
    off!(ibv_send_wr.opcode);
    off!(ibv_send_wr.send_flags);
    off!(ibv_send_wr."invalidate_rkey" = offset_of!(ibv_send_wr, imm_data_invalidated_rkey_union)
        + offset_of!(imm_data_invalidated_rkey_union_t, invalidated_rkey));
    let wr = offset_of!(ibv_send_wr, wr) + offset_of!(wr_t, rdma);
    off!(ibv_send_wr."wr.rdma.remote_addr" = wr + offset_of!(rdma_t, remote_addr));
    off!(ibv_send_wr."wr.rdma.rkey" = wr + offset_of!(rdma_t, rkey));
    off!(ibv_send_wr."qp_type.xrc.remote_srqn" = offset_of!(ibv_send_wr, qp_type)
        + offset_of!(qp_type_t, xrc)
        + offset_of!(xrc_t, remote_srqn));
    let bind = offset_of!(ibv_send_wr, bind_mw_tso_union) + offset_of!(bind_mw_tso_union_t, bind_mw);
    off!(ibv_send_wr."bind_mw.mw" = bind + offset_of!(bind_mw_t, mw));
    off!(ibv_send_wr."bind_mw.rkey" = bind + offset_of!(bind_mw_t, rkey));
    off!(ibv_send_wr."bind_mw.bind_info" = bind + offset_of!(bind_mw_t, bind_info));

    size!(ibv_mw_bind_info);
    off!(ibv_mw_bind_info.mr);
    off!(ibv_mw_bind_info.addr);
    off!(ibv_mw_bind_info.length);
    off!(ibv_mw_bind_info.mw_access_flags);

    size!(ibv_sge);
    off!(ibv_sge.addr);
    off!(ibv_sge.length);
    off!(ibv_sge.lkey);

    size!(ibv_recv_wr);
    off!(ibv_recv_wr.wr_id);
    off!(ibv_recv_wr.next);
    off!(ibv_recv_wr.sg_list);
    off!(ibv_recv_wr.num_sge);

    size!(ibv_gid);
    size!(ibv_global_route);
    off!(ibv_global_route.dgid);
    off!(ibv_global_route.flow_label);
    off!(ibv_global_route.sgid_index);
    off!(ibv_global_route.hop_limit);
    off!(ibv_global_route.traffic_class);

    size!(ibv_ah_attr);
    off!(ibv_ah_attr.grh);
    off!(ibv_ah_attr.dlid);
    off!(ibv_ah_attr.sl);
    off!(ibv_ah_attr.src_path_bits);
    off!(ibv_ah_attr.static_rate);
    off!(ibv_ah_attr.is_global);
    off!(ibv_ah_attr.port_num);

    size!(ibv_qp_cap);
    size!(ibv_qp_attr);
    off!(ibv_qp_attr.qp_state);
    off!(ibv_qp_attr.path_mtu);
    off!(ibv_qp_attr.rq_psn);
    off!(ibv_qp_attr.sq_psn);
    off!(ibv_qp_attr.dest_qp_num);
    off!(ibv_qp_attr.qp_access_flags);
    off!(ibv_qp_attr.cap);
    off!(ibv_qp_attr.ah_attr);
    off!(ibv_qp_attr.pkey_index);
    off!(ibv_qp_attr.max_rd_atomic);
    off!(ibv_qp_attr.max_dest_rd_atomic);
    off!(ibv_qp_attr.min_rnr_timer);
    off!(ibv_qp_attr.port_num);
    off!(ibv_qp_attr.timeout);
    off!(ibv_qp_attr.retry_cnt);
    off!(ibv_qp_attr.rnr_retry);
    off!(ibv_qp_attr.rate_limit);

    size!(ibv_qp_init_attr);
    off!(ibv_qp_init_attr.send_cq);
    off!(ibv_qp_init_attr.recv_cq);
    off!(ibv_qp_init_attr.cap);
    off!(ibv_qp_init_attr.qp_type);
    off!(ibv_qp_init_attr.sq_sig_all);
    off!(ibv_qp_init_attr.srq);

    size!(ibv_srq_init_attr);
    off!(ibv_srq_init_attr.srq_context);
    off!(ibv_srq_init_attr.attr);
    size!(ibv_srq_attr);
    off!(ibv_srq_attr.max_wr);
    off!(ibv_srq_attr.max_sge);
    off!(ibv_srq_attr.srq_limit);
    size!(ibv_async_event);
    off!(ibv_async_event.element);
    off!(ibv_async_event.event_type);
    off!(ibv_context.async_fd);

    size!(ibv_device_attr);
    off!(ibv_device_attr.device_cap_flags);
    off!(ibv_device_attr.max_sge);
    off!(ibv_device_attr.max_qp_wr);
    off!(ibv_device_attr.max_cqe);
    off!(ibv_device_attr.max_qp_rd_atom);
    off!(ibv_device_attr.max_qp_init_rd_atom);
    off!(ibv_device_attr.max_mw);
    off!(ibv_device_attr.phys_port_cnt);
    off!(ibv_device_attr.max_srq);
    off!(ibv_device_attr.max_srq_wr);

    off!(ibv_port_attr.state);
    off!(ibv_port_attr.active_mtu);
    off!(ibv_port_attr.gid_tbl_len);
    off!(ibv_port_attr.lid);
    off!(ibv_port_attr.link_layer);

    off!(ibv_mr.addr);
    off!(ibv_mr.length);
    off!(ibv_mr.lkey);
    off!(ibv_mr.rkey);
    off!(ibv_mw.rkey);
    off!(ibv_mw."type" = offset_of!(ibv_mw, type_));
    off!(ibv_comp_channel.fd);
    off!(ibv_qp.qp_num);
    off!(ibv_device.name);

    // Constants: mwcap's own where it has them, else the binding's.
    macro_rules! konst {
        ($name:ident = $v:expr) => {
            m.insert(concat!("const.", stringify!($name)).to_string(), $v as usize);
        };
    }
    use mwcap::backend::Access;
    konst!(IBV_ACCESS_LOCAL_WRITE = Access::LOCAL_WRITE.bits());
    konst!(IBV_ACCESS_REMOTE_WRITE = Access::REMOTE_WRITE.bits());
    konst!(IBV_ACCESS_REMOTE_READ = Access::REMOTE_READ.bits());
    konst!(IBV_ACCESS_MW_BIND = Access::MW_BIND.bits());
    konst!(IBV_WC_WITH_INV = ibv_wc_flags::IBV_WC_WITH_INV.0);
    konst!(IBV_SEND_SIGNALED = ibv_send_flags::IBV_SEND_SIGNALED.0);
    konst!(IBV_WR_SEND = ibv_wr_opcode::IBV_WR_SEND);
    konst!(IBV_WR_SEND_WITH_INV = ibv_wr_opcode::IBV_WR_SEND_WITH_INV);
    konst!(IBV_WR_RDMA_READ = ibv_wr_opcode::IBV_WR_RDMA_READ);
    konst!(IBV_WR_BIND_MW = ibv_wr_opcode::IBV_WR_BIND_MW);
    konst!(IBV_WR_LOCAL_INV = ibv_wr_opcode::IBV_WR_LOCAL_INV);
    konst!(IBV_WC_RECV = ibv_wc_opcode::IBV_WC_RECV);
    konst!(IBV_WC_BIND_MW = ibv_wc_opcode::IBV_WC_BIND_MW);
    konst!(IBV_WC_LOCAL_INV = ibv_wc_opcode::IBV_WC_LOCAL_INV);
    konst!(IBV_WC_REM_ACCESS_ERR = ibv_wc_status::IBV_WC_REM_ACCESS_ERR);
    konst!(IBV_DEVICE_MEM_WINDOW = ibv_device_cap_flags::IBV_DEVICE_MEM_WINDOW.0);
    konst!(IBV_DEVICE_MEM_WINDOW_TYPE_2A = ibv_device_cap_flags::IBV_DEVICE_MEM_WINDOW_TYPE_2A.0);
    konst!(IBV_DEVICE_MEM_WINDOW_TYPE_2B = ibv_device_cap_flags::IBV_DEVICE_MEM_WINDOW_TYPE_2B.0);
    konst!(IBV_MW_TYPE_2 = ibv_mw_type::IBV_MW_TYPE_2);
    konst!(IBV_QPS_ERR = ibv_qp_state::IBV_QPS_ERR);
    konst!(IBV_SRQ_LIMIT = ibv_srq_attr_mask::IBV_SRQ_LIMIT.0);
    konst!(IBV_EVENT_SRQ_LIMIT_REACHED = ibv_event_type::IBV_EVENT_SRQ_LIMIT_REACHED);
    konst!(IBV_EVENT_QP_LAST_WQE_REACHED = ibv_event_type::IBV_EVENT_QP_LAST_WQE_REACHED);
    m
}

#[test]
fn hand_declared_layouts_match_the_system_headers() {
    let c = c_layout();
    let mut rust = rust_layout();
    let mut problems = Vec::new();
    for (name, &cv) in &c {
        if let Some(base) = name.strip_suffix(".size_at_most") {
            // Passed to libibverbs together with our size: ours may be larger.
            let ours = match base {
                "ibv_port_attr" => size_of::<ibv_port_attr>(),
                other => panic!("no size_at_most rule for {other}"),
            };
            if ours < cv {
                problems.push(format!("{name}: rust {ours} < C {cv}"));
            }
            continue;
        }
        match rust.remove(name) {
            Some(rv) if rv == cv => {}
            Some(rv) => problems.push(format!("{name}: rust {rv}, C {cv}")),
            None => problems.push(format!("{name}: printed by layout.c but not checked on the Rust side")),
        }
    }
    for name in rust.keys() {
        problems.push(format!("{name}: checked on the Rust side but not printed by layout.c"));
    }
    assert!(c.len() > 100, "the C side printed only {} entries", c.len());
    assert!(problems.is_empty(), "layout mismatches:\n{}", problems.join("\n"));
}
