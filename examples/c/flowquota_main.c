/* flowquota as a replica process: `flowquota CONFIG.toml` (a replica config with
 * nf.kind = "c" and optional [c] quota_packets / idle_ms). Runs until SIGTERM/SIGINT or a
 * `shutdown` control request. */
#include "flowquota.h"

#include <inttypes.h>
#include <stdio.h>

static uint64_t setting(PliantCtx *ctx, const char *name, int64_t dflt)
{
	int64_t v;

	if (pliant_config_int(ctx, name, &v) != PLIANT_OK || v < 0)
		v = dflt;
	return (uint64_t)v;
}

int main(int argc, char **argv)
{
	char err[512];
	struct flowquota fq;
	PliantCtx *ctx;
	int rc;

	if (argc != 2) {
		fprintf(stderr, "usage: %s REPLICA_CONFIG.toml\n", argv[0]);
		return 2;
	}
	ctx = pliant_open(argv[1], err, sizeof err);
	if (ctx == NULL) {
		fprintf(stderr, "flowquota: %s\n", err);
		return 1;
	}
	rc = fq_init(&fq, ctx, setting(ctx, "quota_packets", 1000), setting(ctx, "idle_ms", 30000));
	if (rc != PLIANT_OK) {
		fprintf(stderr, "flowquota: init: %s\n", pliant_last_error(ctx));
		pliant_close(ctx);
		return 1;
	}
	fprintf(stderr, "flowquota: running (quota %" PRIu64 " packets per flow, idle %" PRIu64 " ms)\n",
		fq.quota_packets, fq.idle_ms);
	for (;;) {
		rc = fq_run(&fq, 1000);
		if (rc >= 0)
			continue; /* timed out: loop (timers and control requests were served) */
		if (rc == PLIANT_ESTOPPED)
			break;
		fprintf(stderr, "flowquota: %s: %s\n", pliant_strerror(rc), pliant_last_error(ctx));
		break;
	}
	fprintf(stderr, "flowquota: stopping; forwarded %" PRIu64 ", over quota %" PRIu64 "\n",
		fq_total(&fq), pliant_drop_count(ctx, "fq_over_quota"));
	pliant_close(ctx);
	return rc == PLIANT_ESTOPPED ? 0 : 1;
}
