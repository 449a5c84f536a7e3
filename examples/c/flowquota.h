/*
 * flowquota - a per-flow quota firewall written in C against pliant.h.
 *
 * Each flow (both directions, one direction-normalised key) may send `quota_packets` packets;
 * later ones are dropped and counted. A flow idle for `idle_ms` is expired by a flow timer,
 * which frees its state (a new packet starts a fresh quota). A global count of forwarded
 * packets lives in coherent shared state: each replica adds to its own contribution and
 * pushes it; a PULL combines all replicas' contributions with a C sum combiner.
 */
#ifndef FLOWQUOTA_H
#define FLOWQUOTA_H

#include <stdint.h>
#include "pliant.h"

/* Per-flow state, stored as the flow's byte blob in pliant's flow table. */
struct fq_flow {
	uint64_t packets;  /* forwarded */
	uint64_t bytes;    /* forwarded */
	uint64_t dropped;  /* over quota */
};

struct flowquota {
	PliantCtx *ctx;
	uint64_t quota_packets;
	uint64_t idle_ms;
};

#define FQ_TIMER_IDLE 1u
#define FQ_TOTAL_KEY "flowquota_forwarded"

/* Times the sum combiner ran (in this process). */
extern uint64_t fq_combiner_calls;

/* Creates the shared counter and registers the timer callback. Returns a PLIANT_* code. */
int fq_init(struct flowquota *fq, PliantCtx *ctx, uint64_t quota_packets, uint64_t idle_ms);

/* Handles one packet read with pliant_pkt_read (writes or drops it). */
void fq_process(struct flowquota *fq, PliantPkt *pkt);

/* Reads and processes packets until none is queued within timeout_ms; returns the number
 * processed, or a negative PLIANT_* code on an error other than a timeout. */
int fq_run(struct flowquota *fq, int32_t timeout_ms);

/* Packets forwarded by all replicas (PULL through the combiner); 0 on error. */
uint64_t fq_total(struct flowquota *fq);

#endif
