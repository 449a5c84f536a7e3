//! pliant-io (being written).
