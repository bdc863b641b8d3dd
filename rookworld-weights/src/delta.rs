//! A weight payload sent against one the receiver already holds: only what changed.
//!
//! Between two versions most BF16 values are equal and a changed one mostly differs in its
//! last mantissa bits, so the XOR of the two payloads' 16-bit words is mostly zeros, and
//! zeros in its high bytes. The delta cuts that XOR into blocks of [`BLOCK_WORDS`] words;
//! each block's high bytes then its low bytes (two planes: the high plane almost all zero)
//! are compressed with zstd at level 1, and a block with no change is a length of zero. A
//! payload of N bytes and its base must have the same length; the receiver XORs each block
//! back into its copy of the base. Blocks are encoded and applied in parallel.
//!
//! ```text
//! delta  = MAGIC  u64 payload bytes  u32 block words  u32 blocks  (u32 length, bytes)*
//! block  = zstd(high bytes of the XOR's words ‖ low bytes)   (length 0: unchanged)
//! ```
//!
//! The delta says nothing of versions or hashes: the push's header names the base version
//! it is against and the BLAKE3 of the payload it makes, checked after [`apply`] as a full
//! payload's is.

use rayon::prelude::*;

/// Words (16-bit values) per block: 2 MiB of payload.
pub const BLOCK_WORDS: usize = 1 << 20;
/// The delta format's name in a push's header (`WeightSetHeader.delta_format`).
pub const FORMAT: &str = "xor-bf16-zstd";
/// The delta format's first bytes.
pub const MAGIC: &[u8; 8] = b"RWXD0001";
/// zstd's level: the fastest; higher levels gained under 2% on BF16 deltas.
const LEVEL: i32 = 1;
/// Bytes before the blocks.
const HEADER: usize = 8 + 8 + 4 + 4;

/// Why a delta could not be made or applied.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum DeltaError {
    #[error("the base holds {base} bytes and the payload {payload}: a delta needs equal sizes")]
    Sizes { base: usize, payload: usize },
    #[error("an odd payload size ({0} bytes): a BF16 payload is 16-bit words")]
    Odd(usize),
    #[error("not a weight delta (no {} header)", String::from_utf8_lossy(MAGIC))]
    Magic,
    #[error("a malformed delta: {0}")]
    Malformed(String),
    #[error("block {block}: {detail}")]
    Block { block: usize, detail: String },
}

/// The delta that turns `base` into `payload` (equal sizes, whole 16-bit words).
pub fn encode(base: &[u8], payload: &[u8]) -> Result<Vec<u8>, DeltaError> {
    if base.len() != payload.len() {
        return Err(DeltaError::Sizes {
            base: base.len(),
            payload: payload.len(),
        });
    }
    if !payload.len().is_multiple_of(2) {
        return Err(DeltaError::Odd(payload.len()));
    }
    let block_bytes = 2 * BLOCK_WORDS;
    let blocks: Vec<Vec<u8>> = base
        .par_chunks(block_bytes)
        .zip(payload.par_chunks(block_bytes))
        .enumerate()
        .map(|(block, (b, p))| encode_block(block, b, p))
        .collect::<Result<_, _>>()?;
    let mut out = Vec::with_capacity(HEADER + blocks.iter().map(|b| 4 + b.len()).sum::<usize>());
    out.extend_from_slice(MAGIC);
    out.extend_from_slice(&(payload.len() as u64).to_le_bytes());
    out.extend_from_slice(&(BLOCK_WORDS as u32).to_le_bytes());
    out.extend_from_slice(&(blocks.len() as u32).to_le_bytes());
    for b in &blocks {
        out.extend_from_slice(&(b.len() as u32).to_le_bytes());
        out.extend_from_slice(b);
    }
    Ok(out)
}

/// One block's XOR as two planes, compressed; empty when nothing changed.
fn encode_block(block: usize, base: &[u8], payload: &[u8]) -> Result<Vec<u8>, DeltaError> {
    if base == payload {
        return Ok(Vec::new());
    }
    let words = base.len() / 2;
    let mut planes = vec![0u8; 2 * words];
    let (high, low) = planes.split_at_mut(words);
    for (i, (b, p)) in base
        .chunks_exact(2)
        .zip(payload.chunks_exact(2))
        .enumerate()
    {
        // Little-endian words: byte 1 is the high byte (sign, exponent, top mantissa bit).
        low[i] = b[0] ^ p[0];
        high[i] = b[1] ^ p[1];
    }
    zstd::bulk::compress(&planes, LEVEL).map_err(|e| DeltaError::Block {
        block,
        detail: e.to_string(),
    })
}

/// The size of the payload `delta` makes, from its header (checked).
pub fn payload_len(delta: &[u8]) -> Result<usize, DeltaError> {
    Ok(parse(delta)?.0)
}

/// The payload, its block size in words and each block's compressed bytes.
fn parse(delta: &[u8]) -> Result<(usize, usize, Vec<&[u8]>), DeltaError> {
    if delta.len() < HEADER || &delta[..8] != MAGIC {
        return Err(DeltaError::Magic);
    }
    let u64_at = |i: usize| u64::from_le_bytes(delta[i..i + 8].try_into().expect("8 bytes"));
    let u32_at = |i: usize| u32::from_le_bytes(delta[i..i + 4].try_into().expect("4 bytes"));
    let len = usize::try_from(u64_at(8))
        .map_err(|_| DeltaError::Malformed("a payload larger than memory".into()))?;
    let (block_words, count) = (u32_at(16) as usize, u32_at(20) as usize);
    if block_words == 0 || !len.is_multiple_of(2) || count != (len / 2).div_ceil(block_words) {
        return Err(DeltaError::Malformed(format!(
            "{count} blocks of {block_words} words for {len} bytes"
        )));
    }
    let mut blocks = Vec::with_capacity(count);
    let mut at = HEADER;
    for block in 0..count {
        let size = delta
            .get(at..at + 4)
            .map(|_| u32_at(at) as usize)
            .ok_or_else(|| DeltaError::Malformed(format!("block {block}: cut short")))?;
        at += 4;
        let bytes = delta
            .get(at..at + size)
            .ok_or_else(|| DeltaError::Malformed(format!("block {block}: cut short")))?;
        blocks.push(bytes);
        at += size;
    }
    if at != delta.len() {
        return Err(DeltaError::Malformed(format!(
            "{} bytes after the last block",
            delta.len() - at
        )));
    }
    Ok((len, block_words, blocks))
}

/// Turns `base` (a copy of the base payload) into the payload `delta` was made for, in
/// place. On an error `base` may be partly changed: the caller applies to a copy and
/// checks the result's hash.
pub fn apply(base: &mut [u8], delta: &[u8]) -> Result<(), DeltaError> {
    let (len, block_words, blocks) = parse(delta)?;
    if base.len() != len {
        return Err(DeltaError::Sizes {
            base: base.len(),
            payload: len,
        });
    }
    base.par_chunks_mut(2 * block_words)
        .zip(blocks.par_iter())
        .enumerate()
        .try_for_each(|(block, (out, compressed))| {
            if compressed.is_empty() {
                return Ok(());
            }
            let planes =
                zstd::bulk::decompress(compressed, out.len()).map_err(|e| DeltaError::Block {
                    block,
                    detail: e.to_string(),
                })?;
            if planes.len() != out.len() {
                return Err(DeltaError::Block {
                    block,
                    detail: format!("{} bytes for a block of {}", planes.len(), out.len()),
                });
            }
            let (high, low) = planes.split_at(out.len() / 2);
            for (i, word) in out.chunks_exact_mut(2).enumerate() {
                word[0] ^= low[i];
                word[1] ^= high[i];
            }
            Ok(())
        })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A payload of `words` BF16 values, and one where every `every`-th value moved by
    /// one unit in its last place.
    fn pair(words: usize, every: usize) -> (Vec<u8>, Vec<u8>) {
        let base: Vec<u8> = (0..words)
            .flat_map(|i| (0x3c00u16 + (i % 977) as u16).to_le_bytes())
            .collect();
        let mut payload = base.clone();
        for w in payload.chunks_exact_mut(2).step_by(every) {
            w[0] ^= 1;
        }
        (base, payload)
    }

    #[test]
    fn a_delta_applied_to_its_base_gives_the_payload() {
        // Three blocks and a part of one, a tenth of the values changed.
        let (base, payload) = pair(3 * BLOCK_WORDS + 1234, 10);
        let delta = encode(&base, &payload).unwrap();
        assert!(delta.len() < payload.len() / 10, "{} bytes", delta.len());
        assert_eq!(payload_len(&delta).unwrap(), payload.len());
        let mut out = base.clone();
        apply(&mut out, &delta).unwrap();
        assert_eq!(out, payload);
    }

    #[test]
    fn nothing_changed_sends_almost_nothing() {
        let (base, _) = pair(2 * BLOCK_WORDS, 1);
        let delta = encode(&base, &base).unwrap();
        assert_eq!(delta.len(), HEADER + 2 * 4);
        let mut out = base.clone();
        apply(&mut out, &delta).unwrap();
        assert_eq!(out, base);
    }

    #[test]
    fn a_bad_delta_or_base_is_refused_with_its_cause() {
        let (base, payload) = pair(BLOCK_WORDS + 7, 3);
        assert_eq!(
            encode(&base[..10], &payload).unwrap_err(),
            DeltaError::Sizes {
                base: 10,
                payload: payload.len()
            }
        );
        assert_eq!(encode(&[1], &[2]).unwrap_err(), DeltaError::Odd(1));
        let delta = encode(&base, &payload).unwrap();
        let mut short = base[..base.len() - 2].to_vec();
        assert!(matches!(
            apply(&mut short, &delta),
            Err(DeltaError::Sizes { .. })
        ));
        let mut out = base.clone();
        assert_eq!(
            apply(&mut out, b"not a delta at all, no"),
            Err(DeltaError::Magic)
        );
        let cut = &delta[..delta.len() - 5];
        assert!(matches!(
            apply(&mut out, cut),
            Err(DeltaError::Malformed(_))
        ));
        let mut corrupt = delta.clone();
        let last = corrupt.len() - 3;
        corrupt[last] ^= 0xff;
        let mut out = base.clone();
        // A corrupt block fails in zstd, or makes a payload whose hash the push refuses.
        if apply(&mut out, &corrupt).is_ok() {
            assert_ne!(out, payload);
        }
    }
}
