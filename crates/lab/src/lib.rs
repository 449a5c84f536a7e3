//! pliant-lab (being written).
