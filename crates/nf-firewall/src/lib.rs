//! pliant-nf-firewall (being written).
