//! Fixtures for the dataset tests.
