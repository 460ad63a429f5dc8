//! Randomness: SplitMix64, fixed here so the output never changes with a dependency.

use std::fmt::Write as _;

pub(super) struct Rng(pub(super) u64);

impl Rng {
    pub(super) fn for_item(seed: u64, domain: u64, index: u64) -> Rng {
        let mut r = Rng(seed ^ domain.wrapping_mul(0xA076_1D64_78BD_642F));
        let mixed = r.next_u64() ^ index.wrapping_mul(0xE703_7ED1_A0B4_28DB);
        Rng(mixed)
    }

    pub(super) fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// Uniform in [0, 1).
    pub(super) fn f64(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 / (1u64 << 53) as f64
    }

    /// Uniform integer in `lo..=hi`.
    pub(super) fn int(&mut self, lo: usize, hi: usize) -> usize {
        lo + (self.next_u64() % (hi - lo + 1) as u64) as usize
    }

    pub(super) fn chance(&mut self, p: f64) -> bool {
        self.f64() < p
    }

    pub(super) fn pick<'a, T>(&mut self, items: &'a [T]) -> &'a T {
        &items[self.int(0, items.len() - 1)]
    }

    /// Picks by weight from `(weight, item)` pairs.
    pub(super) fn weighted<'a, T>(&mut self, items: &'a [(u32, T)]) -> &'a T {
        let total: u32 = items.iter().map(|(w, _)| w).sum();
        let mut x = (self.next_u64() % total as u64) as u32;
        for (w, item) in items {
            if x < *w {
                return item;
            }
            x -= w;
        }
        &items[items.len() - 1].1
    }

    /// Standard normal (Box–Muller).
    pub(super) fn normal(&mut self) -> f64 {
        let u1 = self.f64().max(1e-12);
        let u2 = self.f64();
        (-2.0 * u1.ln()).sqrt() * (2.0 * std::f64::consts::PI * u2).cos()
    }

    /// Log-normal with the given median and log-space sigma.
    pub(super) fn lognormal(&mut self, median: f64, sigma: f64) -> f64 {
        median * (sigma * self.normal()).exp()
    }

    /// Log-uniform in `[lo, hi]`.
    pub(super) fn log_uniform(&mut self, lo: f64, hi: f64) -> f64 {
        (lo.ln() + self.f64() * (hi.ln() - lo.ln())).exp()
    }

    pub(super) fn hex(&mut self, n: usize) -> String {
        let mut s = String::with_capacity(n);
        while s.len() < n {
            let _ = write!(s, "{:016x}", self.next_u64());
        }
        s.truncate(n);
        s
    }
}
