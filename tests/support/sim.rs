//! Fixtures for the sim tests.
