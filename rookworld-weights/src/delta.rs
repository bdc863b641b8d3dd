//! A weight payload sent against one the receiver already holds: only what changed.
//!
//! Between two versions most BF16 values are equal and a changed one mostly differs in its
//! last mantissa bits, so the XOR of the two payloads' 16-bit words is mostly zeros, and
//! zeros in its high bytes. The delta cuts that XOR into blocks of [`BLOCK_WORDS`] words;
//! each block's high bytes then its low bytes (two planes: the high plane almost all zero)
//! are packed as a mask of which bytes are not zero and those bytes, and that is
//! compressed with zstd at level 1; a block with no change is a length of zero. (zstd alone
//! on the planes was 2× slower and 1.6× larger: it spends its time on the zeros that the
//! mask holds in one bit each.) A payload of N bytes and its base must have the same
//! length; the receiver XORs each block back into its copy of the base. Blocks are encoded and applied in parallel, and a delta
//! can be sent while it is made ([`encode_streamed`]): its header says nothing that needs
//! the blocks, and each block's length comes before it, so its size is known at its end.
//!
//! ```text
//! delta  = MAGIC  u64 payload bytes  u32 block words  u32 blocks  (u32 length, bytes)*
//! block  = zstd(mask ‖ values)                               (length 0: unchanged)
//! planes = high bytes of the block's XOR'd words ‖ their low bytes   (2 × words bytes)
//! mask   = bit i (byte i / 8, bit i % 8, lowest first) set: planes[i] ≠ 0
//! values = the planes' bytes that are not zero, in order
//! ```
//!
//! The delta says nothing of versions or hashes: the push's header names the base version
//! it is against and the BLAKE3 of the payload it makes, checked after [`apply`] as a full
//! payload's is.

use rayon::prelude::*;

/// Words (16-bit values) per block: 2 MiB of payload.
pub const BLOCK_WORDS: usize = 1 << 20;
/// The delta format's name in a push's header (`WeightSetHeader.delta_format`).
pub const FORMAT: &str = "xor-bf16-mask-zstd";
/// The delta format's first bytes.
pub const MAGIC: &[u8; 8] = b"RWXD0002";
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
    let mut out = Vec::new();
    encode_streamed(base, payload, |piece| out.extend_from_slice(&piece))?;
    Ok(out)
}

/// [`encode`], handed to `sink` piece by piece as it is made, in the format's order: the
/// header first (everything in it is known before any block is made), then each block's
/// length and bytes. Blocks are encoded a few at a time on every core and passed on in
/// order, so that a sender streams the delta while the rest is still being made. Returns
/// the delta's size.
pub fn encode_streamed(
    base: &[u8],
    payload: &[u8],
    mut sink: impl FnMut(Vec<u8>),
) -> Result<usize, DeltaError> {
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
    let blocks = payload.len().div_ceil(block_bytes);
    let mut header = Vec::with_capacity(HEADER);
    header.extend_from_slice(MAGIC);
    header.extend_from_slice(&(payload.len() as u64).to_le_bytes());
    header.extend_from_slice(&(BLOCK_WORDS as u32).to_le_bytes());
    header.extend_from_slice(&(blocks as u32).to_le_bytes());
    let mut size = header.len();
    sink(header);
    // Two blocks a core per round: enough that a round's slowest block idles little, few
    // enough that the first bytes leave early.
    let round = 2 * rayon::current_num_threads().max(1);
    let (base, payload) = (base.chunks(block_bytes), payload.chunks(block_bytes));
    let pairs: Vec<(&[u8], &[u8])> = base.zip(payload).collect();
    for (r, pairs) in pairs.chunks(round).enumerate() {
        let pieces: Vec<Vec<u8>> = pairs
            .par_iter()
            .enumerate()
            .map(|(i, (b, p))| encode_block(r * round + i, b, p))
            .collect::<Result<_, _>>()?;
        for piece in pieces {
            size += piece.len();
            sink(piece);
        }
    }
    Ok(size)
}

/// The most bytes a delta of a `payload`-byte payload can take (every block
/// incompressible): a receiver of a delta whose size is not announced refuses more.
pub fn bound(payload: usize) -> usize {
    let block_bytes = 2 * BLOCK_WORDS;
    let (whole, rest) = (payload / block_bytes, payload % block_bytes);
    let block = |bytes: usize| 4 + zstd::zstd_safe::compress_bound(bytes.div_ceil(8) + bytes);
    HEADER + whole * block(block_bytes) + if rest > 0 { block(rest) } else { 0 }
}

/// One block of the format: its length (u32) then its XOR as two planes, packed and
/// compressed (nothing when nothing changed).
fn encode_block(block: usize, base: &[u8], payload: &[u8]) -> Result<Vec<u8>, DeltaError> {
    if base == payload {
        return Ok(0u32.to_le_bytes().to_vec());
    }
    let words = base.len() / 2;
    SCRATCH.with_borrow_mut(|scratch| {
        let Scratch {
            planes,
            packed,
            compressed,
            zstd,
            ..
        } = scratch;
        planes.resize(2 * words, 0);
        let (high, low) = planes.split_at_mut(words);
        split_xor(base, payload, high, low);
        pack(planes, packed);
        compressed.resize(zstd::zstd_safe::compress_bound(packed.len()), 0);
        let fail = |e: std::io::Error| DeltaError::Block {
            block,
            detail: e.to_string(),
        };
        let compressor = match zstd {
            Some(c) => c,
            None => zstd.insert(zstd::bulk::Compressor::new(LEVEL).map_err(fail)?),
        };
        let n = compressor
            .compress_to_buffer(&packed[..], &mut compressed[..])
            .map_err(fail)?;
        let mut piece = Vec::with_capacity(4 + n);
        piece.extend_from_slice(&(n as u32).to_le_bytes());
        piece.extend_from_slice(&compressed[..n]);
        Ok(piece)
    })
}

/// What a thread encoding or applying blocks keeps between them: the planes, the packed
/// and the compressed block and zstd's contexts (made once, not once a block; with the
/// planes' memory, about a third of the encode's time).
#[derive(Default)]
struct Scratch {
    planes: Vec<u8>,
    packed: Vec<u8>,
    compressed: Vec<u8>,
    zstd: Option<zstd::bulk::Compressor<'static>>,
    unzstd: Option<zstd::bulk::Decompressor<'static>>,
}

thread_local! {
    static SCRATCH: std::cell::RefCell<Scratch> = std::cell::RefCell::default();
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
            SCRATCH.with_borrow_mut(|scratch| {
                let fail = |e: std::io::Error| DeltaError::Block {
                    block,
                    detail: e.to_string(),
                };
                let Scratch {
                    planes,
                    packed,
                    unzstd,
                    ..
                } = scratch;
                // One byte more than the most a block packs to: a block that decompresses
                // to more is refused, not cut to fit.
                packed.resize(out.len().div_ceil(8) + out.len() + 1, 0);
                let unzstd = match unzstd {
                    Some(d) => d,
                    None => unzstd.insert(zstd::bulk::Decompressor::new().map_err(fail)?),
                };
                let n = unzstd
                    .decompress_to_buffer(compressed, &mut packed[..])
                    .map_err(fail)?;
                planes.resize(out.len(), 0);
                unpack(&packed[..n], planes)
                    .map_err(|detail| DeltaError::Block { block, detail })?;
                let (high, low) = planes.split_at(out.len() / 2);
                merge_xor(out, high, low);
                Ok(())
            })
        })
}

/// `planes` packed into `out`: a bit for each byte, set where it is not zero (eight bytes
/// a mask byte, the first lowest), then those bytes in order. 64 bytes at a time with
/// AVX-512 VBMI2 where the CPU has it (a test of each byte and a compress), eight at a
/// time otherwise.
fn pack(planes: &[u8], out: &mut Vec<u8>) {
    let mask_len = planes.len().div_ceil(8);
    out.clear();
    // Room for a whole vector stored at the last value.
    out.resize(mask_len + planes.len() + 64, 0);
    let (mask, values) = out.split_at_mut(mask_len);
    let (mut done, mut n) = (0, 0);
    #[cfg(target_arch = "x86_64")]
    if simd::available() {
        // SAFETY: the CPU has the features (checked), and `values` has 64 bytes of room
        // past the most the planes can pack to.
        (done, n) = unsafe { simd::pack(planes, mask, values) };
    }
    n += pack_groups(&planes[done..], &mut mask[done / 8..], &mut values[n..]);
    out.truncate(mask_len + n);
}

/// [`pack`] eight bytes at a time into `mask` and `values` (room for every byte);
/// returns the values written.
fn pack_groups(planes: &[u8], mask: &mut [u8], values: &mut [u8]) -> usize {
    let (whole, rest) = planes.split_at(planes.len() / 8 * 8);
    let mut tail = [0u8; 8];
    tail[..rest.len()].copy_from_slice(rest);
    let groups = whole
        .chunks_exact(8)
        .chain((!rest.is_empty()).then_some(&tail[..]));
    let mut n = 0;
    for (i, group) in groups.enumerate() {
        let x = u64::from_le_bytes(group.try_into().expect("8 bytes"));
        if x == 0 {
            mask[i] = 0;
            continue;
        }
        let mut bits = nonzero_bytes(x);
        mask[i] = bits;
        while bits != 0 {
            values[n] = group[bits.trailing_zeros() as usize];
            n += 1;
            bits &= bits - 1;
        }
    }
    n
}

/// The inverse of [`pack`] into `planes` (its length the block's); refuses a mask and
/// values that do not agree, or a mask that marks a byte past the block.
fn unpack(packed: &[u8], planes: &mut [u8]) -> Result<(), String> {
    let mask_len = planes.len().div_ceil(8);
    if packed.len() < mask_len {
        return Err(format!(
            "{} bytes, less than the {mask_len}-byte mask of a block of {}",
            packed.len(),
            planes.len()
        ));
    }
    let (mask, values) = packed.split_at(mask_len);
    let marked: usize = mask.iter().map(|m| m.count_ones() as usize).sum();
    if marked != values.len() {
        return Err(format!(
            "the mask marks {marked} bytes and {} follow",
            values.len()
        ));
    }
    let (mut done, mut n) = (0, 0);
    #[cfg(target_arch = "x86_64")]
    if simd::available() {
        // SAFETY: the CPU has the features (checked); the mask marks exactly the values
        // (counted above), and no vector is read past them.
        (done, n) = unsafe { simd::unpack(mask, values, planes) };
    } else if shuffle::available() {
        // SAFETY: as above, for SSSE3 and POPCNT.
        (done, n) = unsafe { shuffle::unpack(mask, values, planes) };
    }
    unpack_groups(&mask[done / 8..], &values[n..], &mut planes[done..])
}

/// [`unpack`] eight bytes at a time (the mask and the values agree in number).
fn unpack_groups(mask: &[u8], values: &[u8], planes: &mut [u8]) -> Result<(), String> {
    let mut next = values.iter();
    for (&m, group) in mask.iter().zip(planes.chunks_mut(8)) {
        let mut eight = [0u8; 8];
        let mut bits = m;
        while bits != 0 {
            eight[bits.trailing_zeros() as usize] = *next.next().expect("counted");
            bits &= bits - 1;
        }
        if eight[group.len()..].iter().any(|&b| b != 0) {
            return Err("the mask marks a byte past the block".into());
        }
        group.copy_from_slice(&eight[..group.len()]);
    }
    Ok(())
}

/// [`pack`] and [`unpack`] 64 bytes at a time: a byte test gives the chunk's eight mask
/// bytes, and a compress (an expand) moves its nonzero bytes to (from) the values.
#[cfg(target_arch = "x86_64")]
mod simd {
    use std::arch::x86_64::*;

    pub fn available() -> bool {
        is_x86_feature_detected!("avx512f")
            && is_x86_feature_detected!("avx512bw")
            && is_x86_feature_detected!("avx512vbmi2")
    }

    /// Packs the whole 64-byte chunks of `planes`; returns the plane bytes done and the
    /// values written.
    ///
    /// # Safety
    /// The CPU has AVX-512 F, BW and VBMI2; `values` has 64 bytes of room past the most
    /// the chunks can pack to.
    #[target_feature(enable = "avx512f,avx512bw,avx512vbmi2")]
    pub unsafe fn pack(planes: &[u8], mask: &mut [u8], values: &mut [u8]) -> (usize, usize) {
        let chunks = planes.len() / 64;
        assert!(values.len() >= chunks * 64 + 64 && mask.len() >= chunks * 8);
        let mut n = 0;
        for c in 0..chunks {
            // SAFETY: chunk c is within `planes`; `values` has a vector's room at `n`
            // (n ≤ 64·c, asserted above).
            unsafe {
                let v = _mm512_loadu_si512(planes.as_ptr().add(64 * c).cast());
                let k = _mm512_test_epi8_mask(v, v);
                mask[8 * c..8 * c + 8].copy_from_slice(&k.to_le_bytes());
                if k != 0 {
                    let packed = _mm512_maskz_compress_epi8(k, v);
                    _mm512_storeu_si512(values.as_mut_ptr().add(n).cast(), packed);
                    n += k.count_ones() as usize;
                }
            }
        }
        (64 * chunks, n)
    }

    /// Unpacks the 64-byte chunks of `planes` while a whole vector of values is left to
    /// read; returns the plane bytes done and the values read.
    ///
    /// # Safety
    /// The CPU has AVX-512 F, BW and VBMI2; the mask marks no more bytes than `values`
    /// holds.
    #[target_feature(enable = "avx512f,avx512bw,avx512vbmi2")]
    pub unsafe fn unpack(mask: &[u8], values: &[u8], planes: &mut [u8]) -> (usize, usize) {
        let chunks = (planes.len() / 64).min(mask.len() / 8);
        let mut n = 0;
        for c in 0..chunks {
            if n + 64 > values.len() {
                return (64 * c, n);
            }
            let k = u64::from_le_bytes(mask[8 * c..8 * c + 8].try_into().expect("8 bytes"));
            // SAFETY: 64 bytes of `values` from `n` (checked) and chunk c of `planes`.
            unsafe {
                let v = _mm512_loadu_si512(values.as_ptr().add(n).cast());
                let expanded = _mm512_maskz_expand_epi8(k, v);
                _mm512_storeu_si512(planes.as_mut_ptr().add(64 * c).cast(), expanded);
            }
            n += k.count_ones() as usize;
        }
        (64 * chunks, n)
    }
}

/// [`unpack`] eight bytes at a time through one byte shuffle where the CPU has no
/// AVX-512 VBMI2 (AVX2-only CPUs): a mask byte picks the shuffle that moves its values
/// to their bytes, from a table of all 256; eight mask bytes of zero are 64 zero bytes at
/// once (most of a delta's high plane).
#[cfg(target_arch = "x86_64")]
mod shuffle {
    use std::arch::x86_64::*;

    /// For each mask byte: the source of each of its eight bytes among the next values
    /// (0x80, a zero, where its bit is clear); 16 bytes, a whole shuffle's control.
    const EXPAND: [[u8; 16]; 256] = {
        let mut table = [[0x80u8; 16]; 256];
        let mut m = 0;
        while m < 256 {
            let (mut i, mut next) = (0, 0u8);
            while i < 8 {
                if m & (1 << i) != 0 {
                    table[m][i] = next;
                    next += 1;
                }
                i += 1;
            }
            m += 1;
        }
        table
    };

    pub fn available() -> bool {
        is_x86_feature_detected!("ssse3") && is_x86_feature_detected!("popcnt")
    }

    /// Unpacks the whole eight-byte groups of `planes` while eight values are left to
    /// read; returns the plane bytes done and the values read.
    ///
    /// # Safety
    /// The CPU has SSSE3 and POPCNT; the mask marks no more bytes than `values` holds.
    #[target_feature(enable = "ssse3,popcnt")]
    pub unsafe fn unpack(mask: &[u8], values: &[u8], planes: &mut [u8]) -> (usize, usize) {
        let groups = (planes.len() / 8).min(mask.len());
        let (mut g, mut n) = (0, 0);
        while g < groups {
            if g + 8 <= groups && mask[g..g + 8] == [0; 8] {
                planes[8 * g..8 * g + 64].fill(0);
                g += 8;
                continue;
            }
            if n + 8 > values.len() {
                break;
            }
            let m = mask[g];
            // SAFETY: eight bytes of `values` from `n` (checked) and group g of `planes`
            // (g < planes.len() / 8); the table's rows are 16 bytes.
            unsafe {
                let v = _mm_loadl_epi64(values.as_ptr().add(n).cast());
                let control = _mm_loadu_si128(EXPAND[m as usize].as_ptr().cast());
                let placed = _mm_shuffle_epi8(v, control);
                _mm_storel_epi64(planes.as_mut_ptr().add(8 * g).cast(), placed);
            }
            n += m.count_ones() as usize;
            g += 1;
        }
        (8 * g, n)
    }
}

/// Bit k set where byte k of `x` (little-endian) is not zero.
fn nonzero_bytes(x: u64) -> u8 {
    const LOW7: u64 = 0x7f7f_7f7f_7f7f_7f7f;
    // A byte's top bit: set where its low seven bits carry into it, or were set.
    let top = (((x & LOW7) + LOW7) | x) & !LOW7;
    // Gather the eight top bits, byte k's to bit k.
    ((top >> 7).wrapping_mul(0x0102_0408_1020_4080) >> 56) as u8
}

/// The XOR of `base` and `payload` (little-endian 16-bit words) as two planes: `high[i]`
/// the high byte of word i's XOR (sign, exponent, top mantissa bit), `low[i]` its low
/// byte. Four words at a time in one 64-bit XOR, so that it runs at memory speed (a
/// byte at a time took as long as zstd).
fn split_xor(base: &[u8], payload: &[u8], high: &mut [u8], low: &mut [u8]) {
    let quads = base.len() / 8;
    for (i, (b, p)) in base
        .chunks_exact(8)
        .zip(payload.chunks_exact(8))
        .enumerate()
    {
        let x = u64::from_le_bytes(b.try_into().expect("8 bytes"))
            ^ u64::from_le_bytes(p.try_into().expect("8 bytes"));
        // Bytes 0, 2, 4, 6 are the words' low bytes; 1, 3, 5, 7 their high bytes.
        let (lo, hi) = (gather_even(x), gather_even(x >> 8));
        low[4 * i..4 * i + 4].copy_from_slice(&lo.to_le_bytes());
        high[4 * i..4 * i + 4].copy_from_slice(&hi.to_le_bytes());
    }
    for w in 4 * quads..base.len() / 2 {
        low[w] = base[2 * w] ^ payload[2 * w];
        high[w] = base[2 * w + 1] ^ payload[2 * w + 1];
    }
}

/// XORs the planes of [`split_xor`] back into `out`'s words.
fn merge_xor(out: &mut [u8], high: &[u8], low: &[u8]) {
    let quads = out.len() / 8;
    for (i, o) in out.chunks_exact_mut(8).enumerate() {
        let lo = u32::from_le_bytes(low[4 * i..4 * i + 4].try_into().expect("4 bytes"));
        let hi = u32::from_le_bytes(high[4 * i..4 * i + 4].try_into().expect("4 bytes"));
        let x = spread(lo) | (spread(hi) << 8);
        let v = u64::from_le_bytes((&*o).try_into().expect("8 bytes")) ^ x;
        o.copy_from_slice(&v.to_le_bytes());
    }
    for w in 4 * quads..out.len() / 2 {
        out[2 * w] ^= low[w];
        out[2 * w + 1] ^= high[w];
    }
}

/// Bytes 0, 2, 4 and 6 of `x` as a 32-bit value (byte 0 lowest).
fn gather_even(x: u64) -> u32 {
    let x = x & 0x00ff_00ff_00ff_00ff;
    let x = (x | (x >> 8)) & 0x0000_ffff_0000_ffff;
    ((x | (x >> 16)) & 0xffff_ffff) as u32
}

/// The inverse of [`gather_even`]: `v`'s bytes at bytes 0, 2, 4 and 6, zeros between.
fn spread(v: u32) -> u64 {
    let x = u64::from(v);
    let x = (x | (x << 16)) & 0x0000_ffff_0000_ffff;
    (x | (x << 8)) & 0x00ff_00ff_00ff_00ff
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

    /// The planes are the format's at every length (a whole number of four-word groups or
    /// not): each word's XOR, high bytes then low bytes, so deltas read as before; and
    /// changes in high bytes come back.
    #[test]
    fn the_planes_are_the_xor_s_high_bytes_then_low_bytes_at_every_length() {
        for words in [1, 3, 4, 5, 11, BLOCK_WORDS + 3] {
            let base: Vec<u8> = (0..2 * words).map(|i| (i * 7 % 251) as u8).collect();
            let payload: Vec<u8> = base
                .iter()
                .enumerate()
                .map(|(i, b)| if i % 3 == 0 { b ^ (i as u8 | 1) } else { *b })
                .collect();
            let (mut high, mut low) = (vec![0u8; words], vec![0u8; words]);
            split_xor(&base, &payload, &mut high, &mut low);
            for w in 0..words {
                assert_eq!(
                    low[w],
                    base[2 * w] ^ payload[2 * w],
                    "{words} words, low {w}"
                );
                assert_eq!(high[w], base[2 * w + 1] ^ payload[2 * w + 1], "high {w}");
            }
            let mut out = base.clone();
            merge_xor(&mut out, &high, &low);
            assert_eq!(out, payload, "{words} words");
            let mut out = base.clone();
            apply(&mut out, &encode(&base, &payload).unwrap()).unwrap();
            assert_eq!(out, payload, "{words} words through a delta");
        }
    }

    /// Streamed, a delta comes as its header and then one piece a block, in order, which
    /// together are the delta [`encode`] makes; no delta outgrows [`bound`], not even
    /// one of noise.
    #[test]
    fn a_streamed_delta_comes_header_first_then_a_block_at_a_time_in_order() {
        let (base, payload) = pair(5 * BLOCK_WORDS + 99, 7);
        let mut pieces = Vec::new();
        let size = encode_streamed(&base, &payload, |p| pieces.push(p)).unwrap();
        assert_eq!(pieces.len(), 1 + 6, "the header and six blocks");
        assert_eq!(pieces[0].len(), HEADER);
        assert_eq!(&pieces[0][..8], MAGIC);
        let joined = pieces.concat();
        assert_eq!(joined.len(), size);
        assert_eq!(joined, encode(&base, &payload).unwrap());
        let (_, _, blocks) = parse(&joined).unwrap();
        for (block, piece) in blocks.iter().zip(&pieces[1..]) {
            assert_eq!(&piece[4..], *block, "each piece is its block, in order");
        }

        let mut x = 0x2545_f491_4f6c_dd1du64;
        let noise: Vec<u8> = (0..base.len())
            .map(|_| {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                (x >> 24) as u8
            })
            .collect();
        let worst = encode(&base, &noise).unwrap();
        assert!(worst.len() > base.len(), "noise does not compress");
        assert!(
            worst.len() <= bound(base.len()),
            "{} > {}",
            worst.len(),
            bound(base.len())
        );
    }

    /// The mask marks exactly the bytes that are not zero, and packing then unpacking
    /// gives the planes back at every length; a mask and values that disagree are refused.
    #[test]
    fn a_block_packs_to_a_mask_of_its_nonzero_bytes_and_back() {
        let mut x = 0x9e37_79b9_7f4a_7c15u64;
        let mut next = || {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x
        };
        for _ in 0..10_000 {
            let v = next()
                & [u64::MAX, 0xff, 0x8000_0000_0000_0001, 0x0100_0000_0000_0000]
                    [next() as usize % 4];
            let want = (0..8)
                .filter(|k| (v >> (8 * k)) & 0xff != 0)
                .fold(0, |m, k| m | 1 << k);
            assert_eq!(nonzero_bytes(v), want, "{v:#x}");
        }
        for len in [0usize, 1, 7, 8, 9, 16, 1001] {
            let planes: Vec<u8> = (0..len)
                .map(|_| {
                    if next() % 10 == 0 {
                        next() as u8 | 1
                    } else {
                        0
                    }
                })
                .collect();
            let mut packed = Vec::new();
            pack(&planes, &mut packed);
            let nonzero = planes.iter().filter(|&&b| b != 0).count();
            assert_eq!(packed.len(), len.div_ceil(8) + nonzero, "{len} bytes");
            let mut back = vec![0xaa; len];
            unpack(&packed, &mut back).unwrap();
            assert_eq!(back, planes, "{len} bytes");
        }
        // The vector path (where the CPU has it) against the eight-byte one, at lengths
        // around whole vectors and at the densities of a delta's planes.
        for (len, every) in [
            (64usize, 2u64),
            (640, 11),
            (64 * 33 + 17, 3),
            (1 << 16, 12),
            (4096, 1),
            (64 * 40 + 24, 97),
        ] {
            let planes: Vec<u8> = (0..len)
                .map(|_| {
                    if next() % every == 0 {
                        next() as u8 | 1
                    } else {
                        0
                    }
                })
                .collect();
            let mut packed = Vec::new();
            pack(&planes, &mut packed);
            let mut mask = vec![0; len.div_ceil(8)];
            let mut values = vec![0; len];
            let n = pack_groups(&planes, &mut mask, &mut values);
            assert_eq!(packed, [&mask[..], &values[..n]].concat(), "{len} bytes");
            let mut back = vec![0xaa; len];
            unpack(&packed, &mut back).unwrap();
            assert_eq!(back, planes, "{len} bytes");
            let mut back = vec![0xaa; len];
            unpack_groups(&mask, &values[..n], &mut back).unwrap();
            assert_eq!(back, planes, "{len} bytes");
            #[cfg(target_arch = "x86_64")]
            if shuffle::available() {
                let mut back = vec![0xaa; len];
                // SAFETY: the CPU has the features (checked); the mask marks the values.
                let (done, read) = unsafe { shuffle::unpack(&mask, &values[..n], &mut back) };
                unpack_groups(&mask[done / 8..], &values[read..n], &mut back[done..]).unwrap();
                assert_eq!(back, planes, "{len} bytes, by shuffles");
            }
        }
        let mut planes = vec![0u8; 9];
        assert!(
            unpack(&[0b1, 0], &mut planes)
                .unwrap_err()
                .contains("marks 1 bytes and 0 follow")
        );
        assert!(
            unpack(&[0, 0b10, 5], &mut planes)
                .unwrap_err()
                .contains("past the block")
        );
        assert!(
            unpack(&[0], &mut planes)
                .unwrap_err()
                .contains("less than the 2-byte mask")
        );
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
