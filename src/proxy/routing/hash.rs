//! The hashes placement is built on: published functions only, so that another implementation
//! (a second proxy, a script checking a placement) can reproduce every score.

/// The xxHash64 final avalanche (`XXH64_avalanche` in the xxHash specification): every input
/// bit flips about half the output bits.
#[inline]
pub(crate) fn avalanche(mut h: u64) -> u64 {
    h ^= h >> 33;
    h = h.wrapping_mul(0xC2B2_AE3D_27D4_EB4F);
    h ^= h >> 29;
    h = h.wrapping_mul(0x1656_67B1_9E37_79F9);
    h ^ (h >> 32)
}

/// XXH3-64 of `bytes` with `seed` (xxHash 0.8, as `XXH3_64bits_withSeed`): stable across builds
/// and machines, so every replica places a key identically. Not for adversarial input.
#[inline]
pub(crate) fn hash64(seed: u64, bytes: &[u8]) -> u64 {
    xxhash_rust::xxh3::xxh3_64_with_seed(bytes, seed)
}

/// Rendezvous score of a key for a backend: `-weight / ln(u)` with `u` uniform in (0, 1) drawn
/// from the top 53 bits of `avalanche(key_hash ^ backend_seed)`, the form that gives each
/// backend a share proportional to its weight.
#[inline]
pub(crate) fn rendezvous_score(key_hash: u64, backend_seed: u64, weight: f64) -> f64 {
    let u = (rendezvous_draw(key_hash, backend_seed) as f64 + 0.5) / (1u64 << 53) as f64;
    -weight / u.ln()
}

/// The 53 bits `u` of [`rendezvous_score`] is drawn from. Among backends of one weight the
/// score grows with `u`, so these rank them as the scores do, without a logarithm.
#[inline]
pub(crate) fn rendezvous_draw(key_hash: u64, backend_seed: u64) -> u64 {
    avalanche(key_hash ^ backend_seed) >> 11
}
