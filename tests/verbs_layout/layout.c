/* Prints the size and field offsets of the libibverbs structs mwcap uses,
 * as the system's <infiniband/verbs.h> lays them out. tests/verbs_layout.rs
 * compiles this with `cc` and compares every line with the Rust side. */
#include <infiniband/verbs.h>
#include <stddef.h>
#include <stdio.h>

#define SIZE(t) printf(#t ".size %zu\n", sizeof(struct t))
#define OFF(t, f) printf(#t "." #f " %zu\n", offsetof(struct t, f))
#define USIZE(t) printf(#t ".size %zu\n", sizeof(union t))

int main(void)
{
	SIZE(ibv_wc);
	OFF(ibv_wc, wr_id); OFF(ibv_wc, status); OFF(ibv_wc, opcode);
	OFF(ibv_wc, vendor_err); OFF(ibv_wc, byte_len); OFF(ibv_wc, invalidated_rkey);
	OFF(ibv_wc, qp_num); OFF(ibv_wc, src_qp); OFF(ibv_wc, wc_flags);
	OFF(ibv_wc, pkey_index); OFF(ibv_wc, slid); OFF(ibv_wc, sl); OFF(ibv_wc, dlid_path_bits);

	SIZE(ibv_send_wr);
	OFF(ibv_send_wr, wr_id); OFF(ibv_send_wr, next); OFF(ibv_send_wr, sg_list);
	OFF(ibv_send_wr, num_sge); OFF(ibv_send_wr, opcode); OFF(ibv_send_wr, send_flags);
	OFF(ibv_send_wr, invalidate_rkey);
	OFF(ibv_send_wr, wr.rdma.remote_addr); OFF(ibv_send_wr, wr.rdma.rkey);
	OFF(ibv_send_wr, qp_type.xrc.remote_srqn);
	OFF(ibv_send_wr, bind_mw.mw); OFF(ibv_send_wr, bind_mw.rkey); OFF(ibv_send_wr, bind_mw.bind_info);

	SIZE(ibv_mw_bind_info);
	OFF(ibv_mw_bind_info, mr); OFF(ibv_mw_bind_info, addr);
	OFF(ibv_mw_bind_info, length); OFF(ibv_mw_bind_info, mw_access_flags);

	SIZE(ibv_sge);
	OFF(ibv_sge, addr); OFF(ibv_sge, length); OFF(ibv_sge, lkey);

	SIZE(ibv_recv_wr);
	OFF(ibv_recv_wr, wr_id); OFF(ibv_recv_wr, next); OFF(ibv_recv_wr, sg_list); OFF(ibv_recv_wr, num_sge);

	USIZE(ibv_gid);
	SIZE(ibv_global_route);
	OFF(ibv_global_route, dgid); OFF(ibv_global_route, flow_label); OFF(ibv_global_route, sgid_index);
	OFF(ibv_global_route, hop_limit); OFF(ibv_global_route, traffic_class);

	SIZE(ibv_ah_attr);
	OFF(ibv_ah_attr, grh); OFF(ibv_ah_attr, dlid); OFF(ibv_ah_attr, sl); OFF(ibv_ah_attr, src_path_bits);
	OFF(ibv_ah_attr, static_rate); OFF(ibv_ah_attr, is_global); OFF(ibv_ah_attr, port_num);

	SIZE(ibv_qp_cap);
	SIZE(ibv_qp_attr);
	OFF(ibv_qp_attr, qp_state); OFF(ibv_qp_attr, path_mtu); OFF(ibv_qp_attr, rq_psn);
	OFF(ibv_qp_attr, sq_psn); OFF(ibv_qp_attr, dest_qp_num); OFF(ibv_qp_attr, qp_access_flags);
	OFF(ibv_qp_attr, cap); OFF(ibv_qp_attr, ah_attr); OFF(ibv_qp_attr, pkey_index);
	OFF(ibv_qp_attr, max_rd_atomic); OFF(ibv_qp_attr, max_dest_rd_atomic); OFF(ibv_qp_attr, min_rnr_timer);
	OFF(ibv_qp_attr, port_num); OFF(ibv_qp_attr, timeout); OFF(ibv_qp_attr, retry_cnt);
	OFF(ibv_qp_attr, rnr_retry); OFF(ibv_qp_attr, rate_limit);

	SIZE(ibv_qp_init_attr);
	OFF(ibv_qp_init_attr, send_cq); OFF(ibv_qp_init_attr, recv_cq); OFF(ibv_qp_init_attr, cap);
	OFF(ibv_qp_init_attr, qp_type); OFF(ibv_qp_init_attr, sq_sig_all); OFF(ibv_qp_init_attr, srq);

	SIZE(ibv_srq_init_attr); OFF(ibv_srq_init_attr, srq_context); OFF(ibv_srq_init_attr, attr);
	SIZE(ibv_srq_attr); OFF(ibv_srq_attr, max_wr); OFF(ibv_srq_attr, max_sge); OFF(ibv_srq_attr, srq_limit);
	SIZE(ibv_async_event); OFF(ibv_async_event, element); OFF(ibv_async_event, event_type);
	OFF(ibv_context, async_fd);

	SIZE(ibv_device_attr);
	OFF(ibv_device_attr, device_cap_flags); OFF(ibv_device_attr, max_sge); OFF(ibv_device_attr, max_qp_wr);
	OFF(ibv_device_attr, max_cqe); OFF(ibv_device_attr, max_qp_rd_atom);
	OFF(ibv_device_attr, max_qp_init_rd_atom); OFF(ibv_device_attr, max_mw);
	OFF(ibv_device_attr, phys_port_cnt); OFF(ibv_device_attr, max_srq); OFF(ibv_device_attr, max_srq_wr);

	/* Grown by newer rdma-core (active_speed_ex): only the prefix must match,
	 * libibverbs is told our size. */
	printf("ibv_port_attr.size_at_most %zu\n", sizeof(struct ibv_port_attr));
	OFF(ibv_port_attr, state); OFF(ibv_port_attr, active_mtu); OFF(ibv_port_attr, gid_tbl_len);
	OFF(ibv_port_attr, lid); OFF(ibv_port_attr, link_layer);

	OFF(ibv_mr, addr); OFF(ibv_mr, length); OFF(ibv_mr, lkey); OFF(ibv_mr, rkey);
	OFF(ibv_mw, rkey); OFF(ibv_mw, type);
	OFF(ibv_comp_channel, fd);
	OFF(ibv_qp, qp_num);
	OFF(ibv_device, name);

	/* Constants mwcap relies on (Access bits, opcodes, flags). */
#define CONST(c) printf("const." #c " %lu\n", (unsigned long)(c))
	CONST(IBV_ACCESS_LOCAL_WRITE); CONST(IBV_ACCESS_REMOTE_WRITE); CONST(IBV_ACCESS_REMOTE_READ);
	CONST(IBV_ACCESS_MW_BIND); CONST(IBV_WC_WITH_INV); CONST(IBV_SEND_SIGNALED);
	CONST(IBV_WR_SEND); CONST(IBV_WR_SEND_WITH_INV); CONST(IBV_WR_RDMA_READ);
	CONST(IBV_WR_BIND_MW); CONST(IBV_WR_LOCAL_INV);
	CONST(IBV_WC_RECV); CONST(IBV_WC_BIND_MW); CONST(IBV_WC_LOCAL_INV); CONST(IBV_WC_REM_ACCESS_ERR);
	CONST(IBV_DEVICE_MEM_WINDOW); CONST(IBV_DEVICE_MEM_WINDOW_TYPE_2A); CONST(IBV_DEVICE_MEM_WINDOW_TYPE_2B);
	CONST(IBV_MW_TYPE_2); CONST(IBV_QPS_ERR);
	CONST(IBV_SRQ_LIMIT); CONST(IBV_EVENT_SRQ_LIMIT_REACHED); CONST(IBV_EVENT_QP_LAST_WQE_REACHED);
	return 0;
}
