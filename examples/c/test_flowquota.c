/* Tests of flowquota and of the C ABI, on in-memory replicas (no namespaces, fake clock).
 * Exits non-zero on the first failed check. */
#include "flowquota.h"

#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define IP(a, b, c, d) (((uint32_t)(a) << 24) | ((uint32_t)(b) << 16) | ((uint32_t)(c) << 8) | (uint32_t)(d))
#define CLIENT IP(10, 0, 1, 2)
#define SERVER IP(10, 0, 2, 2)
#define PROTO_UDP 17

static const uint8_t client_mac[6] = {0x02, 0, 0, 0, 0x01, 0x02};
static const uint8_t server_mac[6] = {0x02, 0, 0, 0, 0x02, 0x02};
static int checks;

#define CHECK(cond, ...)                                                              \
	do {                                                                          \
		checks++;                                                             \
		if (!(cond)) {                                                        \
			fprintf(stderr, "%s:%d: check failed: %s: ", __FILE__, __LINE__, #cond); \
			fprintf(stderr, __VA_ARGS__);                                 \
			fputc('\n', stderr);                                          \
			exit(1);                                                      \
		}                                                                     \
	} while (0)

#define CHECK_RC(ctx, rc, want)                                                         \
	CHECK((rc) == (want), "got %s, want %s (%s)", pliant_strerror(rc), pliant_strerror(want), \
	      pliant_last_error(ctx))

static PliantCtx *open_mem(void)
{
	char err[256];
	PliantCtx *ctx = pliant_open_mem(NULL, err, sizeof err);

	CHECK(ctx != NULL, "pliant_open_mem: %s", err);
	CHECK_RC(ctx, pliant_mem_learn(ctx, PLIANT_SIDE_INSIDE, CLIENT, client_mac), PLIANT_OK);
	CHECK_RC(ctx, pliant_mem_learn(ctx, PLIANT_SIDE_OUTSIDE, SERVER, server_mac), PLIANT_OK);
	return ctx;
}

/* Injects one UDP datagram client:cport -> server:53 (inside) or back (outside). */
static void send_udp(PliantCtx *ctx, int side, uint16_t cport)
{
	uint8_t frame[128], router_mac[6];
	const char payload[] = "flowquota";
	size_t n;

	CHECK_RC(ctx, pliant_port_mac(ctx, side, router_mac), PLIANT_OK);
	if (side == PLIANT_SIDE_INSIDE)
		n = pliant_build_udp(frame, sizeof frame, client_mac, router_mac, CLIENT, cport, SERVER, 53,
				     (const uint8_t *)payload, sizeof payload - 1);
	else
		n = pliant_build_udp(frame, sizeof frame, server_mac, router_mac, SERVER, 53, CLIENT, cport,
				     (const uint8_t *)payload, sizeof payload - 1);
	CHECK(n > 0 && n <= sizeof frame, "frame of %zu bytes", n);
	CHECK_RC(ctx, pliant_mem_inject(ctx, side, frame, n), PLIANT_OK);
}

/* Takes every frame the replica sent; counts those of flow `key` per side. */
static int take_frames(PliantCtx *ctx, const PliantFlowKey *key, int *inside, int *outside)
{
	uint8_t buf[2048];
	size_t len;
	int side, total = 0;
	PliantFlowKey k;

	*inside = *outside = 0;
	while (pliant_mem_take(ctx, &side, buf, sizeof buf, &len) == PLIANT_OK) {
		total++;
		if (pliant_frame_key(buf, len, &k) != PLIANT_OK || memcmp(&k, key, sizeof k) != 0)
			continue;
		if (side == PLIANT_SIDE_INSIDE)
			(*inside)++;
		else
			(*outside)++;
	}
	return total;
}

static uint64_t flow_packets(PliantCtx *ctx, const PliantFlowKey *key)
{
	struct fq_flow f;
	size_t len;
	int err;
	void *st = pliant_get_flow(ctx, key, &len, &err);

	CHECK(st != NULL, "get_flow: %s (%s)", pliant_strerror(err), pliant_last_error(ctx));
	CHECK(len == sizeof f, "state of %zu bytes", len);
	memcpy(&f, st, sizeof f);
	CHECK_RC(ctx, pliant_put_flow(ctx, key, false), PLIANT_OK);
	return f.packets;
}

static void test_quota_and_forwarding(void)
{
	PliantCtx *ctx = open_mem();
	struct flowquota fq;
	PliantFlowKey a = pliant_key_v4(PROTO_UDP, CLIENT, 1000, SERVER, 53);
	PliantFlowKey b = pliant_key_v4(PROTO_UDP, CLIENT, 1001, SERVER, 53);
	int in, out;

	CHECK_RC(ctx, fq_init(&fq, ctx, 3, 1000), PLIANT_OK);
	for (int i = 0; i < 5; i++)
		send_udp(ctx, PLIANT_SIDE_INSIDE, 1000);
	CHECK(fq_run(&fq, 0) == 5, "processed");
	take_frames(ctx, &a, &in, &out);
	CHECK(out == 3 && in == 0, "flow a: %d out, %d in; want 3 out", out, in);
	CHECK(pliant_drop_count(ctx, "fq_over_quota") == 2, "over quota drops");
	CHECK(flow_packets(ctx, &a) == 3, "flow a packets");

	/* Both directions are one flow: the reply is forwarded back inside. */
	send_udp(ctx, PLIANT_SIDE_INSIDE, 1001);
	send_udp(ctx, PLIANT_SIDE_OUTSIDE, 1001);
	CHECK(fq_run(&fq, 0) == 2, "processed");
	take_frames(ctx, &b, &in, &out);
	CHECK(out == 1 && in == 1, "flow b: %d out, %d in; want 1 and 1", out, in);
	CHECK(flow_packets(ctx, &b) == 2, "flow b packets");
	CHECK(fq_total(&fq) == 5, "total %" PRIu64, fq_total(&fq));
	CHECK(pliant_flow_count(ctx) == 2, "flows");
	CHECK_RC(ctx, pliant_close(ctx), PLIANT_OK);
}

static void test_idle_expiry(void)
{
	PliantCtx *ctx = open_mem();
	struct flowquota fq;
	PliantFlowKey a = pliant_key_v4(PROTO_UDP, CLIENT, 2000, SERVER, 53);
	int in, out;

	CHECK_RC(ctx, fq_init(&fq, ctx, 2, 1000), PLIANT_OK);
	send_udp(ctx, PLIANT_SIDE_INSIDE, 2000);
	send_udp(ctx, PLIANT_SIDE_INSIDE, 2001);
	CHECK(fq_run(&fq, 0) == 2, "processed");
	CHECK_RC(ctx, pliant_mem_advance(ctx, 500), PLIANT_OK);
	CHECK(pliant_flow_count(ctx) == 2, "nothing expired at 500 ms");
	send_udp(ctx, PLIANT_SIDE_INSIDE, 2001); /* re-arms 2001's timer to 1500 ms */
	CHECK(fq_run(&fq, 0) == 1, "processed");
	CHECK_RC(ctx, pliant_mem_advance(ctx, 700), PLIANT_OK); /* t = 1200 ms */
	CHECK(pliant_flow_count(ctx) == 1, "flow 2000 expired, 2001 alive");
	CHECK(pliant_nf_counter(ctx, "fq_expired") == 1, "expired counter");
	CHECK_RC(ctx, pliant_mem_advance(ctx, 400), PLIANT_OK); /* t = 1600 ms */
	CHECK(pliant_flow_count(ctx) == 0, "both expired");
	CHECK(pliant_nf_counter(ctx, "fq_expired") == 2, "expired counter");

	/* An expired flow starts a fresh quota. */
	take_frames(ctx, &a, &in, &out);
	for (int i = 0; i < 3; i++)
		send_udp(ctx, PLIANT_SIDE_INSIDE, 2000);
	CHECK(fq_run(&fq, 0) == 3, "processed");
	take_frames(ctx, &a, &in, &out);
	CHECK(out == 2, "fresh quota: %d forwarded, want 2", out);
	CHECK_RC(ctx, pliant_close(ctx), PLIANT_OK);
}

static void test_migration_and_shared_total(void)
{
	char err[256];
	PliantCtx *r1 = open_mem(), *r2;
	struct flowquota fq1, fq2;
	PliantFlowKey c = pliant_key_v4(PROTO_UDP, CLIENT, 3000, SERVER, 53);
	PliantFlowKey got;
	uint8_t rec[1024];
	size_t len = 0;
	int in, out, e;
	uint64_t calls;

	r2 = pliant_open_mem_peer(r1, err, sizeof err);
	CHECK(r2 != NULL, "peer: %s", err);
	CHECK_RC(r2, pliant_mem_learn(r2, PLIANT_SIDE_INSIDE, CLIENT, client_mac), PLIANT_OK);
	CHECK_RC(r2, pliant_mem_learn(r2, PLIANT_SIDE_OUTSIDE, SERVER, server_mac), PLIANT_OK);
	CHECK_RC(r1, fq_init(&fq1, r1, 3, 1000), PLIANT_OK);
	CHECK_RC(r2, fq_init(&fq2, r2, 3, 1000), PLIANT_OK);

	send_udp(r1, PLIANT_SIDE_INSIDE, 3000);
	send_udp(r1, PLIANT_SIDE_INSIDE, 3000);
	CHECK(fq_run(&fq1, 0) == 2, "processed");

	/* A short buffer refuses and keeps the flow here. */
	CHECK_RC(r1, pliant_export_flow(r1, &c, rec, 4, &len), PLIANT_ENOSPC);
	CHECK(len > 4 && len <= sizeof rec, "needed length %zu", len);
	CHECK(pliant_flow_count(r1) == 1, "flow still on r1");
	/* A flow with an open transaction cannot be exported. */
	CHECK(pliant_get_flow(r1, &c, NULL, &e) != NULL, "get");
	CHECK_RC(r1, pliant_export_flow(r1, &c, rec, sizeof rec, &len), PLIANT_EBUSY);
	CHECK_RC(r1, pliant_put_flow(r1, &c, false), PLIANT_OK);
	CHECK_RC(r1, pliant_export_flow(r1, &c, rec, sizeof rec, &len), PLIANT_OK);

	/* r1 knows the flow left: MIGRATED, not NOT FOUND; its late packets are not forwarded. */
	CHECK(pliant_get_flow(r1, &c, NULL, &e) == NULL && e == PLIANT_EMIGRATED, "got %s",
	      pliant_strerror(e));
	CHECK_RC(r1, pliant_create_flow(r1, &c, 8), PLIANT_EMIGRATED);
	send_udp(r1, PLIANT_SIDE_INSIDE, 3000);
	CHECK(fq_run(&fq1, 0) == 1, "processed");
	CHECK(pliant_drop_count(r1, "fq_migrated") == 1, "late packet dropped on r1");

	/* r2 continues the flow with its state (2 packets used) and its idle timer. */
	CHECK_RC(r2, pliant_import_flow(r2, rec, len, &got), PLIANT_OK);
	CHECK(memcmp(&got, &c, sizeof c) == 0, "imported key");
	CHECK_RC(r2, pliant_import_flow(r2, rec, len, NULL), PLIANT_EEXIST);
	rec[0] ^= 0xff;
	CHECK_RC(r2, pliant_import_flow(r2, rec, len, NULL), PLIANT_EDECODE);
	CHECK(flow_packets(r2, &c) == 2, "state travelled");
	take_frames(r2, &c, &in, &out);
	for (int i = 0; i < 2; i++)
		send_udp(r2, PLIANT_SIDE_INSIDE, 3000);
	CHECK(fq_run(&fq2, 0) == 2, "processed");
	take_frames(r2, &c, &in, &out);
	CHECK(out == 1, "quota continues on r2: %d forwarded, want 1", out);
	CHECK(pliant_drop_count(r2, "fq_over_quota") == 1, "over quota on r2");
	CHECK_RC(r2, pliant_mem_advance(r2, 1001), PLIANT_OK);
	CHECK(pliant_flow_count(r2) == 0, "the timer travelled and fired on r2");

	/* The global total: r1 forwarded 2, r2 forwarded 1; a PULL on either combines both
	 * contributions with the C sum combiner. */
	calls = fq_combiner_calls;
	CHECK(fq_total(&fq1) == 3, "total on r1 %" PRIu64, fq_total(&fq1));
	CHECK(fq_total(&fq2) == 3, "total on r2 %" PRIu64, fq_total(&fq2));
	CHECK(fq_combiner_calls > calls, "the C combiner ran");
	CHECK_RC(r2, pliant_close(r2), PLIANT_OK);
	CHECK_RC(r1, pliant_close(r1), PLIANT_OK);
}

static int reentry_rc;

static void reenter(PliantCtx *ctx, const PliantFlowKey *key, uint32_t id, void *user)
{
	PliantPkt *p;

	(void)key, (void)id, (void)user;
	reentry_rc = pliant_pkt_read(ctx, 0, &p);
}

static void test_misuse_is_an_error(void)
{
	PliantCtx *ctx = open_mem();
	PliantFlowKey k = pliant_key_v4(PROTO_UDP, CLIENT, 4000, SERVER, 53);
	PliantPkt *pkt, *bogus = (PliantPkt *)&k;
	PliantShared sh;
	int e;

	CHECK_RC(ctx, pliant_pkt_read(ctx, 0, NULL), PLIANT_EINVAL);
	CHECK(pliant_pkt_read(NULL, 0, &pkt) == PLIANT_EINVAL, "null ctx");
	CHECK(pliant_get_flow(NULL, &k, NULL, &e) == NULL && e == PLIANT_EINVAL, "null ctx");
	CHECK(pliant_get_flow(ctx, NULL, NULL, &e) == NULL && e == PLIANT_EINVAL, "null key");
	CHECK(pliant_get_flow(ctx, &k, NULL, &e) == NULL && e == PLIANT_ENOTFOUND, "unknown flow");
	CHECK_RC(ctx, pliant_put_flow(ctx, &k, false), PLIANT_ENOTOPEN);
	CHECK_RC(ctx, pliant_create_flow(ctx, &k, 1u << 30), PLIANT_EINVAL);
	CHECK_RC(ctx, pliant_create_flow(ctx, &k, 16), PLIANT_OK);
	CHECK_RC(ctx, pliant_create_flow(ctx, &k, 16), PLIANT_EEXIST);
	CHECK(pliant_get_flow(ctx, &k, NULL, &e) != NULL, "get");
	CHECK_RC(ctx, pliant_delete_flow(ctx, &k), PLIANT_EBUSY);
	CHECK_RC(ctx, pliant_put_flow(ctx, &k, true), PLIANT_OK);
	CHECK_RC(ctx, pliant_put_flow(ctx, &k, true), PLIANT_ENOTOPEN);
	CHECK_RC(ctx, pliant_delete_flow(ctx, &k), PLIANT_OK);

	send_udp(ctx, PLIANT_SIDE_INSIDE, 4000);
	CHECK_RC(ctx, pliant_pkt_read(ctx, 0, &pkt), PLIANT_OK);
	CHECK(pliant_pkt_ingress(pkt) == PLIANT_SIDE_INSIDE, "ingress");
	CHECK(pliant_pkt_sport(pkt) == 4000 && pliant_pkt_dport(pkt) == 53, "ports");
	CHECK(pliant_pkt_src_ipv4(pkt) == CLIENT, "src");
	CHECK_RC(ctx, pliant_pkt_write(ctx, &k, bogus), PLIANT_EINVAL);
	CHECK_RC(ctx, pliant_pkt_drop(ctx, pkt, "Not A Label"), PLIANT_EINVAL);
	CHECK_RC(ctx, pliant_pkt_write_direct(ctx, pkt), PLIANT_OK);
	CHECK_RC(ctx, pliant_pkt_write_direct(ctx, pkt), PLIANT_ENOTOPEN);
	CHECK(pliant_pkt_len(pkt) == 0 && pliant_pkt_data(pkt) == NULL, "released packet");

	/* Shared state modes: a strong key (no combiner) refuses LOCAL. */
	CHECK_RC(ctx, pliant_create_shared(ctx, "strong", (const uint8_t *)"x", 1, NULL), PLIANT_OK);
	CHECK_RC(ctx, pliant_get_shared(ctx, "strong", PLIANT_GET_LOCAL, &sh), PLIANT_EMODE);
	CHECK_RC(ctx, pliant_get_shared(ctx, "strong", PLIANT_GET_SYNCH, &sh), PLIANT_OK);
	CHECK(sh.value_len == 1 && sh.value[0] == 'x', "strong value");
	sh.value[0] = 'y';
	CHECK_RC(ctx, pliant_put_shared(ctx, "strong", PLIANT_PUT_SYNCH), PLIANT_OK);
	CHECK_RC(ctx, pliant_put_shared(ctx, "strong", PLIANT_PUT_SYNCH), PLIANT_ENOTOPEN);
	CHECK_RC(ctx, pliant_get_shared(ctx, "missing", PLIANT_GET_PULL, &sh), PLIANT_ENOTFOUND);

	/* A timer callback may not re-enter pkt_read. */
	CHECK_RC(ctx, pliant_create_flow(ctx, &k, 1), PLIANT_OK);
	CHECK_RC(ctx, pliant_flow_timer(ctx, &k, 10, 7), PLIANT_OK);
	CHECK_RC(ctx, pliant_on_timer(ctx, reenter, NULL), PLIANT_OK);
	CHECK_RC(ctx, pliant_mem_advance(ctx, 20), PLIANT_OK);
	CHECK(reentry_rc == PLIANT_EBUSY, "re-entry gave %s", pliant_strerror(reentry_rc));
	CHECK_RC(ctx, pliant_close(ctx), PLIANT_OK);
	CHECK(pliant_close(NULL) == PLIANT_EINVAL, "close null");
}

int main(void)
{
	test_quota_and_forwarding();
	test_idle_expiry();
	test_migration_and_shared_total();
	test_misuse_is_an_error();
	printf("test_flowquota: %d checks passed\n", checks);
	return 0;
}
