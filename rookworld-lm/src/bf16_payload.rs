//! The bfloat16 safetensors payload of f32 CPU weights, built in place: one buffer of the
//! file's size, the header first, then every tensor converted straight into its slot, in
//! parallel pieces. The generic path (`to_dtype`, then `safetensors::serialize`) converts
//! on one thread and copies each tensor twice; this is what a weight push pays per step.
//! [`load`] is the way back for the worker: bfloat16 to f32 in parallel pieces.
//!
//! Layout (the safetensors format): an 8-byte little-endian header length, the JSON
//! header (`__metadata__`, then per tensor `dtype`, `shape`, `data_offsets`) padded with
//! spaces to a multiple of 8, then the tensors' bytes in header order.

use candle_core::{DType, Device, Storage, Tensor};
use rayon::prelude::*;

use crate::error::Result;

/// Elements converted by one parallel piece.
const PIECE: usize = 1 << 18;

/// Where everything lies in a payload: the header (its 8-byte length, then the JSON padded
/// to a multiple of 8) and each tensor's byte range, in the order given.
#[derive(Debug, Clone, PartialEq)]
pub struct Layout {
    header: Vec<u8>,
    slots: Vec<std::ops::Range<usize>>,
    len: usize,
}

impl Layout {
    /// The layout of bfloat16 `tensors` (name, shape) with `metadata`.
    pub fn new(tensors: &[(String, Vec<usize>)], metadata: &[(&str, &str)]) -> Self {
        let mut header = serde_json::Map::new();
        let meta: serde_json::Map<String, serde_json::Value> = metadata
            .iter()
            .map(|(k, v)| ((*k).to_owned(), serde_json::Value::from(*v)))
            .collect();
        header.insert("__metadata__".into(), meta.into());
        let mut end = 0usize;
        let mut ranges = Vec::with_capacity(tensors.len());
        for (name, shape) in tensors {
            let start = end;
            end += shape.iter().product::<usize>() * 2;
            ranges.push(start..end);
            header.insert(
                name.clone(),
                serde_json::json!({"dtype": "BF16", "shape": shape, "data_offsets": [start, end]}),
            );
        }
        let mut json = serde_json::to_vec(&header).expect("header serialises");
        json.resize(json.len().next_multiple_of(8), b' ');
        let mut bytes = (json.len() as u64).to_le_bytes().to_vec();
        bytes.extend_from_slice(&json);
        let data_start = bytes.len();
        let slots = ranges
            .into_iter()
            .map(|r| r.start + data_start..r.end + data_start)
            .collect();
        Self {
            header: bytes,
            slots,
            len: data_start + end,
        }
    }

    /// The layout of `tensors`' names and shapes.
    pub fn of(tensors: &[(String, Tensor)], metadata: &[(&str, &str)]) -> Self {
        let shapes: Vec<(String, Vec<usize>)> = tensors
            .iter()
            .map(|(n, t)| (n.clone(), t.dims().to_vec()))
            .collect();
        Self::new(&shapes, metadata)
    }

    /// The payload's size in bytes.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether the payload is empty (it never is: the header is there).
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Where the data section starts: the header's length.
    pub fn data_start(&self) -> usize {
        self.header.len()
    }

    /// The byte range of tensor `i`.
    pub fn slot(&self, i: usize) -> std::ops::Range<usize> {
        self.slots[i].clone()
    }

    /// Writes the header into the first bytes of `payload` (of [`Layout::len`] bytes).
    pub fn write_header(&self, payload: &mut [u8]) {
        payload[..self.header.len()].copy_from_slice(&self.header);
    }

    /// Every tensor's slot of `payload`, in order.
    pub fn slots_mut<'a>(&self, payload: &'a mut [u8]) -> Vec<&'a mut [u8]> {
        let mut rest = &mut payload[..self.len];
        let mut at = 0;
        let mut out = Vec::with_capacity(self.slots.len());
        for r in &self.slots {
            let (_, tail) = rest.split_at_mut(r.start - at);
            let (slot, tail) = tail.split_at_mut(r.len());
            out.push(slot);
            rest = tail;
            at = r.end;
        }
        out
    }
}

/// The bfloat16 bits of `x`, rounded to nearest even — bit for bit `half`'s
/// `bf16::from_f32` (candle's `to_dtype(BF16)`), NaNs quieted the same way — but without
/// branches, so loops over it vectorise: `(bits + 0x7fff + lsb) >> 16`.
#[inline(always)]
pub fn bf16_bits(x: f32) -> u16 {
    let b = x.to_bits();
    let rounded = (b.wrapping_add(0x7fff + ((b >> 16) & 1)) >> 16) as u16;
    let nan = ((b >> 16) as u16) | 0x0040;
    if b & 0x7fff_ffff > 0x7f80_0000 {
        nan
    } else {
        rounded
    }
}

/// `src` as bfloat16 ([`bf16_bits`]), little endian, into `dst` (2 bytes per value).
#[inline]
pub fn write_bf16(src: &[f32], dst: &mut [u8]) {
    // SAFETY: every bit pattern is a valid u16; the slices stay within `dst`.
    let (head, words, tail) = unsafe { dst.align_to_mut::<u16>() };
    if head.is_empty() && tail.is_empty() {
        // Aligned (slots start at even offsets of an allocation).
        #[cfg(target_arch = "x86_64")]
        if cfg!(target_endian = "little") && std::arch::is_x86_feature_detected!("avx2") {
            // SAFETY: AVX2 is present.
            unsafe { avx2::stream_bf16(src, words) };
            return;
        }
        for (x, d) in src.iter().zip(words) {
            *d = bf16_bits(*x).to_le();
        }
    } else {
        for (x, d) in src.iter().zip(dst.chunks_exact_mut(2)) {
            d.copy_from_slice(&bf16_bits(*x).to_le_bytes());
        }
    }
}

/// Little-endian bfloat16 `src` (2 bytes per value) as f32 into `dst` (exact).
#[inline]
pub fn read_bf16(src: &[u8], dst: &mut [f32]) {
    assert_eq!(
        src.len(),
        dst.len() * 2,
        "bfloat16 bytes for {} values",
        dst.len()
    );
    #[cfg(target_arch = "x86_64")]
    if cfg!(target_endian = "little") && std::arch::is_x86_feature_detected!("avx2") {
        // SAFETY: AVX2 is present; `src` holds 2 bytes per value of `dst`.
        unsafe { avx2::stream_f32(src, dst) };
        return;
    }
    for (v, b) in dst.iter_mut().zip(src.chunks_exact(2)) {
        *v = f32::from_bits(u32::from(u16::from_le_bytes([b[0], b[1]])) << 16);
    }
}

/// [`read_bf16`] in parallel pieces.
pub fn read_bf16_parallel(src: &[u8], dst: &mut [f32]) {
    assert_eq!(
        src.len(),
        dst.len() * 2,
        "bfloat16 bytes for {} values",
        dst.len()
    );
    dst.par_chunks_mut(PIECE)
        .zip(src.par_chunks(PIECE * 2))
        .for_each(|(d, s)| read_bf16(s, d));
}

#[cfg(target_arch = "x86_64")]
mod avx2 {
    use std::arch::x86_64::*;

    use super::bf16_bits;

    /// [`bf16_bits`] of 16 values at a time, written with non-temporal stores: the
    /// payload is read next by another thread (the hash) or another process, so its lines
    /// need not be read in first nor kept in this core's cache — the optimizer's pass
    /// stays at its own memory traffic.
    ///
    /// # Safety
    /// The CPU has AVX2 (the lengths are checked: the shorter slice bounds the work).
    #[target_feature(enable = "avx2")]
    pub(super) unsafe fn stream_bf16(src: &[f32], dst: &mut [u16]) {
        let n = src.len().min(dst.len());
        let mut i = 0;
        while i < n && !(dst.as_ptr() as usize + 2 * i).is_multiple_of(32) {
            dst[i] = bf16_bits(src[i]);
            i += 1;
        }
        let abs = _mm256_set1_epi32(0x7fff_ffff);
        let inf = _mm256_set1_epi32(0x7f80_0000);
        let bias = _mm256_set1_epi32(0x7fff);
        let one = _mm256_set1_epi32(1);
        let quiet = _mm256_set1_epi32(0x0040_0000);
        // 8 values: RNE `(b + 0x7fff + lsb) >> 16`, NaNs `(b | quiet bit) >> 16`.
        let round = |b: __m256i| {
            let lsb = _mm256_and_si256(_mm256_srli_epi32::<16>(b), one);
            let rounded = _mm256_add_epi32(b, _mm256_add_epi32(bias, lsb));
            let nan = _mm256_cmpgt_epi32(_mm256_and_si256(b, abs), inf);
            let chosen = _mm256_blendv_epi8(rounded, _mm256_or_si256(b, quiet), nan);
            _mm256_srli_epi32::<16>(chosen)
        };
        while i + 16 <= n {
            // SAFETY: i + 16 ≤ n for both slices; dst + i is 32-byte aligned.
            unsafe {
                let a = _mm256_loadu_si256(src.as_ptr().add(i).cast());
                let b = _mm256_loadu_si256(src.as_ptr().add(i + 8).cast());
                let packed = _mm256_packus_epi32(round(a), round(b)); // lanes interleaved
                let ordered = _mm256_permute4x64_epi64::<0b11_01_10_00>(packed);
                _mm256_stream_si256(dst.as_mut_ptr().add(i).cast(), ordered);
            }
            i += 16;
        }
        while i < n {
            dst[i] = bf16_bits(src[i]);
            i += 1;
        }
        _mm_sfence();
    }

    /// Little-endian bfloat16 `src` widened to f32 (the bits shifted up 16) 8 values at a
    /// time, written with non-temporal stores: the values are read next by other passes
    /// or threads, long after, so `dst`'s lines need neither be read in first nor kept in
    /// this core's cache.
    ///
    /// # Safety
    /// The CPU has AVX2, and `src` holds at least `2 * dst.len()` bytes.
    #[target_feature(enable = "avx2")]
    pub(super) unsafe fn stream_f32(src: &[u8], dst: &mut [f32]) {
        let n = dst.len();
        let widen = |i: usize| {
            f32::from_bits(u32::from(u16::from_le_bytes([src[2 * i], src[2 * i + 1]])) << 16)
        };
        let mut i = 0;
        while i < n && !(dst.as_ptr() as usize + 4 * i).is_multiple_of(32) {
            dst[i] = widen(i);
            i += 1;
        }
        while i + 8 <= n {
            // SAFETY: i + 8 ≤ n values: 16 bytes of `src` at 2·i, 32 of `dst` at i, which
            // is 32-byte aligned.
            unsafe {
                let half = _mm_loadu_si128(src.as_ptr().add(2 * i).cast());
                let wide = _mm256_slli_epi32::<16>(_mm256_cvtepu16_epi32(half));
                _mm256_stream_si256(dst.as_mut_ptr().add(i).cast(), wide);
            }
            i += 8;
        }
        while i < n {
            dst[i] = widen(i);
            i += 1;
        }
        _mm_sfence();
    }
}

/// `src` as bfloat16 into `dst`, in parallel pieces.
pub fn write_bf16_parallel(src: &[f32], dst: &mut [u8]) {
    src.par_chunks(PIECE)
        .zip(dst.par_chunks_mut(PIECE * 2))
        .for_each(|(s, d)| write_bf16(s, d));
}

/// The payload of `tensors` (name, f32 tensor on the CPU) with `metadata`, or `None` when
/// a tensor is not f32, not on the CPU or not contiguous (the caller takes the generic
/// path). Values are rounded to nearest even, as candle's `to_dtype(BF16)`.
pub fn build(tensors: &[(String, Tensor)], metadata: &[(&str, &str)]) -> Result<Option<Vec<u8>>> {
    if tensors.iter().any(|(_, t)| {
        t.dtype() != DType::F32 || !matches!(t.device(), Device::Cpu) || !t.is_contiguous()
    }) {
        return Ok(None);
    }
    let layout = Layout::of(tensors, metadata);
    let mut out = vec![0u8; layout.len()];
    layout.write_header(&mut out);

    // Every tensor's f32 values, borrowed from its storage while the guards live.
    let guards: Vec<_> = tensors
        .iter()
        .map(|(_, t)| t.storage_and_layout())
        .collect();
    let mut sources: Vec<&[f32]> = Vec::with_capacity(tensors.len());
    for (guard, (_, t)) in guards.iter().zip(tensors) {
        let (storage, layout) = (&*guard.0, guard.1);
        let Storage::Cpu(cpu) = storage else {
            return Ok(None);
        };
        let all = cpu.as_slice::<f32>()?;
        let start = layout.start_offset();
        sources.push(&all[start..start + t.elem_count()]);
    }
    // Pieces of at most PIECE elements, each with its slot.
    let mut pieces: Vec<(&[f32], &mut [u8])> = Vec::new();
    for (src, slot) in sources.into_iter().zip(layout.slots_mut(&mut out)) {
        pieces.extend(src.chunks(PIECE).zip(slot.chunks_mut(PIECE * 2)));
    }
    pieces
        .into_par_iter()
        .for_each(|(src, dst)| write_bf16(src, dst));
    Ok(Some(out))
}

/// The tensors of safetensors `bytes` on the CPU, as [`host_tensors`] reads them.
pub fn load(bytes: &[u8], to_f32: bool) -> Result<std::collections::HashMap<String, Tensor>> {
    let st = safetensors::SafeTensors::deserialize(bytes)?;
    host_tensors(st.tensors(), to_f32)
}

/// Tensors on the CPU from safetensors `views` (a payload in memory, or files mapped
/// into it): f32 ones copied, and bfloat16 ones widened to f32 when `to_f32` (exact:
/// every bfloat16 is an f32), each in parallel pieces, so that a checkpoint's first
/// touch of its fresh pages (most of a worker's start) runs on every core. Other
/// dtypes load as stored.
pub fn host_tensors<'a>(
    views: impl IntoIterator<Item = (String, safetensors::tensor::TensorView<'a>)>,
    to_f32: bool,
) -> Result<std::collections::HashMap<String, Tensor>> {
    let mut out = std::collections::HashMap::new();
    for (name, view) in views {
        let src = view.data();
        let tensor = match view.dtype() {
            safetensors::Dtype::BF16 if to_f32 => {
                let mut values = vec![0f32; src.len() / 2];
                read_bf16_parallel(src, &mut values);
                Tensor::from_vec(values, view.shape(), &Device::Cpu)?
            }
            safetensors::Dtype::F32 if cfg!(target_endian = "little") => {
                let mut values = vec![0f32; src.len() / 4];
                read_f32_parallel(src, &mut values);
                Tensor::from_vec(values, view.shape(), &Device::Cpu)?
            }
            _ => candle_core::safetensors::Load::load(&view, &Device::Cpu)?,
        };
        out.insert(name, tensor);
    }
    Ok(out)
}

/// Little-endian f32 bytes `src` (at any alignment) into `dst`, in parallel pieces.
pub fn read_f32_parallel(src: &[u8], dst: &mut [f32]) {
    assert_eq!(
        src.len(),
        dst.len() * 4,
        "f32 bytes for {} values",
        dst.len()
    );
    dst.par_chunks_mut(PIECE)
        .zip(src.par_chunks(PIECE * 4))
        .for_each(|(d, s)| {
            for (v, b) in d.iter_mut().zip(s.chunks_exact(4)) {
                *v = f32::from_le_bytes([b[0], b[1], b[2], b[3]]);
            }
        });
}

/// A tensor's values as a payload stores them: little-endian bfloat16 or f32 bytes (a
/// safetensors view's data).
#[derive(Debug, Clone, Copy)]
pub enum StoredValues<'a> {
    Bf16(&'a [u8]),
    F32(&'a [u8]),
}

impl StoredValues<'_> {
    /// The values as f32 into `dst` of as many elements (exact), in parallel pieces.
    pub fn read_into(self, dst: &mut [f32]) -> candle_core::Result<()> {
        match self {
            Self::Bf16(src) if src.len() == dst.len() * 2 => read_bf16_parallel(src, dst),
            Self::F32(src) if src.len() == dst.len() * 4 => read_f32_parallel(src, dst),
            _ => candle_core::bail!("{} stored bytes for {} values", self.len(), dst.len()),
        }
        Ok(())
    }

    /// Values `range` (elements, not bytes) of these.
    pub fn slice(self, range: std::ops::Range<usize>) -> Self {
        match self {
            Self::Bf16(b) => Self::Bf16(&b[range.start * 2..range.end * 2]),
            Self::F32(b) => Self::F32(&b[range.start * 4..range.end * 4]),
        }
    }

    fn len(self) -> usize {
        match self {
            Self::Bf16(b) | Self::F32(b) => b.len(),
        }
    }

    /// How many values these bytes store.
    pub fn elem_count(self) -> usize {
        match self {
            Self::Bf16(b) => b.len() / 2,
            Self::F32(b) => b.len() / 4,
        }
    }
}

/// Writes `src` over the values of `tensor`, a contiguous f32 or bfloat16 tensor of as
/// many elements, in place (bfloat16 into bfloat16 is a copy, bfloat16 into f32 exact, f32
/// into bfloat16 rounded as [`bf16_bits`]). A tensor cloned from `tensor` sees the values.
/// On CUDA only the copies (the same dtype) are written, from page-locked memory in one
/// transfer (`cuda::upload`).
pub fn overwrite(tensor: &Tensor, src: StoredValues<'_>) -> candle_core::Result<()> {
    tensor.inplace_op1(&Overwrite { src })
}

struct Overwrite<'a> {
    src: StoredValues<'a>,
}

impl candle_core::InplaceOp1 for Overwrite<'_> {
    fn name(&self) -> &'static str {
        "overwrite"
    }

    fn cpu_fwd(
        &self,
        storage: &mut candle_core::CpuStorage,
        layout: &candle_core::Layout,
    ) -> candle_core::Result<()> {
        let Some((a, b)) = layout.contiguous_offsets() else {
            candle_core::bail!("overwrite: the tensor is not contiguous");
        };
        match storage {
            candle_core::CpuStorage::F32(all) => self.src.read_into(&mut all[a..b]),
            candle_core::CpuStorage::BF16(all) => {
                let dst = &mut all[a..b];
                match self.src {
                    StoredValues::Bf16(src) if src.len() == dst.len() * 2 => dst
                        .par_chunks_mut(PIECE)
                        .zip(src.par_chunks(PIECE * 2))
                        .for_each(|(d, s)| {
                            for (v, b) in d.iter_mut().zip(s.chunks_exact(2)) {
                                *v = half::bf16::from_bits(u16::from_le_bytes([b[0], b[1]]));
                            }
                        }),
                    StoredValues::F32(src) if src.len() == dst.len() * 4 => dst
                        .par_chunks_mut(PIECE)
                        .zip(src.par_chunks(PIECE * 4))
                        .for_each(|(d, s)| {
                            for (v, b) in d.iter_mut().zip(s.chunks_exact(4)) {
                                let x = f32::from_le_bytes([b[0], b[1], b[2], b[3]]);
                                *v = half::bf16::from_bits(bf16_bits(x));
                            }
                        }),
                    src => candle_core::bail!(
                        "overwrite: {} bytes for {} values",
                        src.len(),
                        dst.len()
                    ),
                }
                Ok(())
            }
            _ => candle_core::bail!("overwrite: the tensor is neither f32 nor bfloat16"),
        }
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        storage: &mut candle_core::CudaStorage,
        layout: &candle_core::Layout,
    ) -> candle_core::Result<()> {
        let Some((a, b)) = layout.contiguous_offsets() else {
            candle_core::bail!("overwrite: the tensor is not contiguous");
        };
        use candle_core::cuda::CudaStorageSlice;
        let (bytes, size) = match (&storage.slice, self.src) {
            (CudaStorageSlice::BF16(_), StoredValues::Bf16(src)) => (src, 2),
            (CudaStorageSlice::F32(_), StoredValues::F32(src)) => (src, 4),
            _ => candle_core::bail!("overwrite: on CUDA only values of the tensor's own dtype"),
        };
        if bytes.len() != (b - a) * size {
            candle_core::bail!("overwrite: {} bytes for {} values", bytes.len(), b - a);
        }
        crate::cuda::upload_into(storage, a, bytes)
    }
}

#[cfg(test)]
mod tests {
    use half::bf16;

    use super::*;

    #[test]
    fn every_bfloat16_widens_exactly_at_any_alignment_and_length() {
        let all: Vec<u16> = (0..=u16::MAX).collect();
        let bytes: Vec<u8> = all.iter().flat_map(|b| b.to_le_bytes()).collect();
        for (skip, len) in [(0, all.len()), (1, 37), (3, 8), (5, 1000), (7, 0)] {
            let mut out = vec![0f32; len + 8];
            let dst = &mut out[skip..skip + len];
            read_bf16(&bytes[2 * skip..2 * (skip + len)], dst);
            for (i, v) in dst.iter().enumerate() {
                assert_eq!(
                    v.to_bits(),
                    u32::from(all[skip + i]) << 16,
                    "value {}",
                    skip + i
                );
                if !v.is_nan() {
                    // (`half` quiets signalling NaNs; the bits are kept here.)
                    assert_eq!(*v, bf16::from_bits(all[skip + i]).to_f32());
                }
            }
        }
        let mut par = vec![0f32; all.len()];
        read_bf16_parallel(&bytes, &mut par);
        assert!(
            par.iter()
                .zip(&all)
                .all(|(v, b)| v.to_bits() == u32::from(*b) << 16)
        );
    }
    use crate::config::Config;
    use crate::model_io::init_random;

    #[test]
    fn the_payload_holds_what_the_generic_path_writes() {
        let model = init_random(&Config::tiny(), 3, DType::F32, &Device::Cpu).unwrap();
        let tensors = model.named_tensors();
        let fast = build(&tensors, &[("format", "pt")]).unwrap().unwrap();
        let converted: Vec<(String, Tensor)> = tensors
            .iter()
            .map(|(n, t)| (n.clone(), t.to_dtype(DType::BF16).unwrap()))
            .collect();
        let generic = safetensors::serialize(converted, None).unwrap();
        let (a, b) = (
            safetensors::SafeTensors::deserialize(&fast).unwrap(),
            safetensors::SafeTensors::deserialize(&generic).unwrap(),
        );
        assert_eq!(a.len(), tensors.len());
        for (name, _) in &tensors {
            let (x, y) = (a.tensor(name).unwrap(), b.tensor(name).unwrap());
            assert_eq!(x.dtype(), safetensors::Dtype::BF16, "{name}");
            assert_eq!(x.shape(), y.shape(), "{name}");
            assert_eq!(x.data(), y.data(), "{name}: bit-identical values");
        }
        let (_, meta) = safetensors::SafeTensors::read_metadata(&fast).unwrap();
        assert_eq!(meta.metadata().as_ref().unwrap()["format"], "pt");
    }

    #[test]
    fn the_branchless_rounding_is_half_s_bit_for_bit() {
        let mut specials = vec![
            0.0f32,
            -0.0,
            1.0,
            f32::MAX,
            f32::MIN,
            f32::MIN_POSITIVE,
            f32::INFINITY,
            f32::NEG_INFINITY,
            f32::NAN,
            -f32::NAN,
            f32::from_bits(0x7f80_0001), // signalling NaN
            f32::from_bits(0x7f7f_ffff), // rounds to infinity
            f32::from_bits(0x3f80_8000), // a tie, even below: stays
            f32::from_bits(0x3f81_8000), // a tie, odd below: rounds up
            f32::from_bits(0x0000_8000), // subnormal tie
        ];
        // Every high half with a spread of low halves, ties and neighbours included.
        for hi in (0..=0xffffu32).step_by(7) {
            for lo in [0u32, 1, 0x7fff, 0x8000, 0x8001, 0xffff, 0x1234] {
                specials.push(f32::from_bits(hi << 16 | lo));
            }
        }
        // The vector path (aligned and not, every tail length) writes the same.
        let mut bytes = vec![0u8; specials.len() * 2 + 2];
        for offset in [0, 1, 2] {
            for len in [specials.len(), 17, 15, 1] {
                let dst = &mut bytes[offset..offset + len * 2];
                write_bf16(&specials[..len], dst);
                for (x, d) in specials.iter().zip(dst.chunks_exact(2)) {
                    assert_eq!(
                        u16::from_le_bytes([d[0], d[1]]),
                        bf16::from_f32(*x).to_bits()
                    );
                }
            }
        }
        for x in specials {
            assert_eq!(
                bf16_bits(x),
                bf16::from_f32(x).to_bits(),
                "{x:e} ({:#010x})",
                x.to_bits()
            );
        }
    }

    #[test]
    fn loading_to_f32_equals_candle_s_conversion() {
        let model = init_random(&Config::tiny(), 4, DType::F32, &Device::Cpu).unwrap();
        let bytes = build(&model.named_tensors(), &[]).unwrap().unwrap();
        let fast = load(&bytes, true).unwrap();
        let generic = candle_core::safetensors::load_buffer(&bytes, &Device::Cpu).unwrap();
        assert_eq!(fast.len(), generic.len());
        for (name, g) in generic {
            let f = &fast[&name];
            assert_eq!(f.dtype(), DType::F32);
            let g: Vec<f32> = g
                .to_dtype(DType::F32)
                .unwrap()
                .flatten_all()
                .unwrap()
                .to_vec1()
                .unwrap();
            let f: Vec<f32> = f.flatten_all().unwrap().to_vec1().unwrap();
            assert_eq!(f, g, "{name}");
        }
    }

    #[test]
    fn other_dtypes_take_the_generic_path() {
        let model = init_random(&Config::tiny(), 3, DType::BF16, &Device::Cpu).unwrap();
        assert!(build(&model.named_tensors(), &[]).unwrap().is_none());
    }
}
