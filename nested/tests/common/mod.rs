//! Helpers shared by the nested integration tests.

pub mod linux;
