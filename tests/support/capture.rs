//! Fixtures for the capture tests.
