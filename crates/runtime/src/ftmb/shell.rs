//! The engine's `NetworkFunction` in FTMB mode: a stand-in that only names the NF. The engine
//! hands IP packets to the FTMB workers before its NF is ever called, so `process` is reached
//! only if a packet slipped past that hook (counted, never silently lost).

use super::nf::FtmbNf;
use crate::nf::{Ctx, NetworkFunction, Packet};
use std::marker::PhantomData;

pub struct FtmbShell<F: FtmbNf> {
    _nf: PhantomData<fn() -> F>,
}

impl<F: FtmbNf> Default for FtmbShell<F> {
    fn default() -> Self {
        FtmbShell { _nf: PhantomData }
    }
}

impl<F: FtmbNf> NetworkFunction for FtmbShell<F> {
    type Flow = ();
    const NAME: &'static str = F::NAME;

    fn process(&mut self, ctx: &mut Ctx<()>, pkt: Packet) {
        ctx.pkt_drop(pkt, "ftmb_not_dispatched");
    }

    fn set_port_blocks(
        &mut self,
        _ctx: &mut Ctx<()>,
        _blocks: &[(u16, u16)],
    ) -> Result<serde_json::Value, String> {
        Err(format!(
            "set_port_blocks is not supported in ftmb mode: the {} NF's port pool is a shared \
             variable fixed by its config section",
            F::NAME
        ))
    }
}
