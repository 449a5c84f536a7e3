//! Fuzz target: `pliant_net::parse` on arbitrary bytes must not panic, and for every frame it
//! accepts, each rewrite must keep the checksums equal to a from-scratch recomputation and the
//! frame must re-parse to the updated `Parsed` (see `pliant_net::selfcheck`).
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| {
    if let Err(violation) = pliant_net::selfcheck::parse_and_rewrite(data) {
        panic!("round-trip property violated: {violation}");
    }
});
