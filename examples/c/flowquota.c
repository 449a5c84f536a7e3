/* flowquota - see flowquota.h. The packet path, top to bottom:
 *   fq_process: key -> get_flow (create on first packet) -> quota check -> count, re-arm the
 *               idle timer -> put_flow -> shared total -> pkt_write
 *   fq_on_timer: idle timer -> delete_flow
 */
#include "flowquota.h"

#include <stdio.h>
#include <string.h>

uint64_t fq_combiner_calls;

/* acc += other, as little-endian u64 counters (ignores values of another size). */
static void fq_sum_u64(uint8_t *acc, size_t acc_len, const uint8_t *other, size_t other_len)
{
	uint64_t a = 0, b = 0;

	fq_combiner_calls++;
	if (acc_len != 8 || other_len != 8)
		return;
	for (int i = 7; i >= 0; i--) {
		a = (a << 8) | acc[i];
		b = (b << 8) | other[i];
	}
	a += b;
	for (int i = 0; i < 8; i++)
		acc[i] = (uint8_t)(a >> (8 * i));
}

static uint64_t le64(const uint8_t *p)
{
	uint64_t v = 0;

	for (int i = 7; i >= 0; i--)
		v = (v << 8) | p[i];
	return v;
}

static void fq_on_timer(PliantCtx *ctx, const PliantFlowKey *key, uint32_t timer_id, void *user)
{
	(void)user;
	if (timer_id != FQ_TIMER_IDLE)
		return;
	/* EBUSY cannot happen here (no get_flow is open across packets); a flow that is
	 * already gone is fine too. */
	if (pliant_delete_flow(ctx, key) == PLIANT_OK)
		pliant_count(ctx, "fq_expired", 1);
}

int fq_init(struct flowquota *fq, PliantCtx *ctx, uint64_t quota_packets, uint64_t idle_ms)
{
	static const uint8_t zero[8];
	int rc;

	fq->ctx = ctx;
	fq->quota_packets = quota_packets;
	fq->idle_ms = idle_ms;
	rc = pliant_create_shared(ctx, FQ_TOTAL_KEY, zero, sizeof zero, fq_sum_u64);
	if (rc != PLIANT_OK && rc != PLIANT_EEXIST)
		return rc;
	return pliant_on_timer(ctx, fq_on_timer, fq);
}

/* Adds one to this replica's contribution and publishes it. */
static void fq_add_total(struct flowquota *fq)
{
	PliantShared sh;

	if (pliant_get_shared(fq->ctx, FQ_TOTAL_KEY, PLIANT_GET_LOCAL, &sh) != PLIANT_OK) {
		pliant_count(fq->ctx, "fq_shared_error", 1);
		return;
	}
	if (sh.value_len == 8) {
		uint64_t v = le64(sh.value) + 1;
		for (int i = 0; i < 8; i++)
			sh.value[i] = (uint8_t)(v >> (8 * i));
	}
	pliant_put_shared(fq->ctx, FQ_TOTAL_KEY, PLIANT_PUT_PUSH);
}

void fq_process(struct flowquota *fq, PliantPkt *pkt)
{
	PliantCtx *ctx = fq->ctx;
	PliantFlowKey key = pliant_pkt_key(pkt);
	struct fq_flow f;
	size_t len = 0;
	int err = PLIANT_OK;
	void *st = pliant_get_flow(ctx, &key, &len, &err);

	if (st == NULL && err == PLIANT_ENOTFOUND) {
		err = pliant_create_flow(ctx, &key, sizeof f);
		if (err == PLIANT_OK)
			st = pliant_get_flow(ctx, &key, &len, &err);
	}
	if (st == NULL) {
		/* MIGRATED: the flow lives on another replica now (steering will send its packets
		 * there); FULL: the flow table is at its bound. Either way, not ours to forward. */
		pliant_pkt_drop(ctx, pkt, err == PLIANT_EMIGRATED ? "fq_migrated" : "fq_no_state");
		return;
	}
	if (len != sizeof f) {
		/* State imported from an incompatible version: refuse rather than misread it. */
		pliant_put_flow(ctx, &key, false);
		pliant_pkt_drop(ctx, pkt, "fq_bad_state");
		return;
	}
	memcpy(&f, st, sizeof f); /* the blob has no alignment guarantee */
	if (f.packets >= fq->quota_packets) {
		f.dropped++;
		memcpy(st, &f, sizeof f);
		pliant_put_flow(ctx, &key, true);
		pliant_pkt_drop(ctx, pkt, "fq_over_quota");
		return;
	}
	f.packets++;
	f.bytes += pliant_pkt_len(pkt);
	memcpy(st, &f, sizeof f);
	/* Re-arming replaces the pending idle timer: the flow expires idle_ms after its last
	 * forwarded packet. */
	pliant_flow_timer(ctx, &key, fq->idle_ms, FQ_TIMER_IDLE);
	pliant_put_flow(ctx, &key, true);
	fq_add_total(fq);
	pliant_pkt_write(ctx, &key, pkt);
}

int fq_run(struct flowquota *fq, int32_t timeout_ms)
{
	PliantPkt *pkt;
	int n = 0, rc;

	while ((rc = pliant_pkt_read(fq->ctx, timeout_ms, &pkt)) == PLIANT_OK) {
		fq_process(fq, pkt);
		n++;
	}
	return rc == PLIANT_ETIMEDOUT ? n : rc;
}

uint64_t fq_total(struct flowquota *fq)
{
	PliantShared sh;
	uint64_t v = 0;

	if (pliant_get_shared(fq->ctx, FQ_TOTAL_KEY, PLIANT_GET_PULL, &sh) != PLIANT_OK)
		return 0;
	if (sh.view_len == 8)
		v = le64(sh.view);
	pliant_put_shared(fq->ctx, FQ_TOTAL_KEY, PLIANT_PUT_LOCAL);
	return v;
}
