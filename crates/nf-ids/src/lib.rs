//! pliant-nf-ids (being written).
