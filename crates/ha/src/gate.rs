//! Output commit: which checkpoint each packet waits for, held output per group, release on
//! ack. CONTRACT (implemented by the ha-engine helper): `OutputGate`, `Dep`.
