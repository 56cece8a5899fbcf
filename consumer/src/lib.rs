//! consumer
