//! Fixtures for the backends tests.
