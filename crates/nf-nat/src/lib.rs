//! pliant-nf-nat (being written).
