//! TCP bootstrap of RC queue pairs (being written).
