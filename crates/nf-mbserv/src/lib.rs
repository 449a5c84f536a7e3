//! pliant-nf-mbserv (being written).
