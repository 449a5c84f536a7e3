//! `forward`: the trivial NF. Every IP packet leaves by the opposite port, no state at all.
//! A baseline for measuring the runtime's own cost and a smoke test of the packet path.

use crate::nf::{Ctx, NetworkFunction, Packet};
use serde::{Deserialize, Serialize};

/// `[forward]` section (optional; nothing to configure yet).
#[derive(Clone, Debug, Default, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Config {}

#[derive(Default)]
pub struct Forward {}

impl Forward {
    pub fn new(_cfg: Config) -> Result<Self, String> {
        Ok(Forward {})
    }
}

impl NetworkFunction for Forward {
    type Flow = ();
    const NAME: &'static str = "forward";

    fn process(&mut self, ctx: &mut Ctx<()>, pkt: Packet) {
        // Stateless: no flow state depends on it, so it is direct output by design.
        ctx.pkt_write_direct(pkt);
    }
}
