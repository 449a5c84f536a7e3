//! pliant-bench (being written).
