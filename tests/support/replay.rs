//! Fixtures for the replay tests.
