//! GPT-2 byte-level BPE through the `tokenizers` crate.
//!
//! [`Tokenizer::gpt2`] is built into the binary (the GPT-2 `tokenizer.json`), so nothing
//! is ever downloaded. A model directory may bring its own `tokenizer.json`, or
//! `vocab.json` + `merges.txt`. No prefix space, no special tokens added on encode:
//! callers prepend end-of-text themselves where they want a BOS.

use std::path::Path;

use tokenizers::decoders::byte_level::ByteLevel as ByteLevelDecoder;
use tokenizers::models::bpe::BPE;
use tokenizers::pre_tokenizers::byte_level::ByteLevel;
use tokenizers::processors::byte_level::ByteLevel as ByteLevelProcessor;
use tokenizers::{AddedToken, Tokenizer as HfTokenizer};

use crate::config::EOT_TOKEN;
use crate::error::{Error, Result};

/// The GPT-2 `tokenizer.json`, embedded at build time.
const GPT2_TOKENIZER_JSON: &[u8] = include_bytes!("../assets/gpt2-tokenizer.json");
const EOT_TEXT: &str = "<|endoftext|>";

/// A GPT-2-style tokenizer.
#[derive(Clone)]
pub struct Tokenizer {
    inner: HfTokenizer,
}

impl std::fmt::Debug for Tokenizer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Tokenizer")
            .field("vocab_size", &self.vocab_size())
            .finish()
    }
}

impl Tokenizer {
    /// The built-in GPT-2 tokenizer (RookWorld-LM's).
    pub fn gpt2() -> Self {
        let inner = HfTokenizer::from_bytes(GPT2_TOKENIZER_JSON)
            .expect("the embedded GPT-2 tokenizer.json is valid");
        Self { inner }
    }

    /// Reads `tokenizer.json`, or else `vocab.json` + `merges.txt`, from `dir`.
    /// `Ok(None)` when the directory has neither.
    pub fn from_dir(dir: &Path) -> Result<Option<Self>> {
        let json = dir.join("tokenizer.json");
        if json.is_file() {
            return Self::from_tokenizer_json(&json).map(Some);
        }
        let (vocab, merges) = (dir.join("vocab.json"), dir.join("merges.txt"));
        if vocab.is_file() && merges.is_file() {
            return Self::from_vocab_merges(&vocab, &merges).map(Some);
        }
        Ok(None)
    }

    /// Loads a `tokenizer.json`.
    pub fn from_tokenizer_json(path: &Path) -> Result<Self> {
        let inner = HfTokenizer::from_file(path)
            .map_err(|e| Error::Tokenizer(format!("{}: {e}", path.display())))?;
        Ok(Self { inner })
    }

    /// Builds GPT-2's byte-level BPE from `vocab.json` and `merges.txt`.
    pub fn from_vocab_merges(vocab: &Path, merges: &Path) -> Result<Self> {
        let bpe = BPE::from_file(&vocab.to_string_lossy(), &merges.to_string_lossy())
            .build()
            .map_err(|e| {
                Error::Tokenizer(format!("{} / {}: {e}", vocab.display(), merges.display()))
            })?;
        let mut inner = HfTokenizer::new(bpe);
        inner
            .with_pre_tokenizer(Some(ByteLevel::default().add_prefix_space(false)))
            .with_decoder(Some(ByteLevelDecoder::default()))
            .with_post_processor(Some(ByteLevelProcessor::default().trim_offsets(false)));
        inner
            .add_special_tokens([AddedToken::from(EOT_TEXT, true)])
            .map_err(|e| Error::Tokenizer(e.to_string()))?;
        Ok(Self { inner })
    }

    /// Token ids of `text`, exactly as the model was trained on them (no BOS added).
    pub fn encode(&self, text: &str) -> Result<Vec<u32>> {
        let enc = self
            .inner
            .encode_fast(text, false)
            .map_err(|e| Error::Tokenizer(e.to_string()))?;
        Ok(enc.get_ids().to_vec())
    }

    /// The ids a prompt is fed as: `bos` (the model's `bos_token_id`), then the tokens of
    /// `text` — as RookWorld-LM's training documents began.
    pub fn encode_prompt(&self, bos: u32, text: &str) -> Result<Vec<u32>> {
        let mut ids = vec![bos];
        ids.extend(self.encode(text)?);
        Ok(ids)
    }

    /// Text of `ids`; end-of-text tokens are dropped.
    pub fn decode(&self, ids: &[u32]) -> Result<String> {
        let kept: Vec<u32> = ids.iter().copied().filter(|&id| id != EOT_TOKEN).collect();
        self.inner
            .decode(&kept, false)
            .map_err(|e| Error::Tokenizer(e.to_string()))
    }

    /// Vocabulary size, added tokens included.
    pub fn vocab_size(&self) -> usize {
        self.inner.get_vocab_size(true)
    }

    /// The `tokenizer.json` text, indented as `transformers`' `save_pretrained` writes it
    /// (for the built-in GPT-2 tokenizer, the same bytes).
    pub fn to_json(&self) -> Result<String> {
        self.inner
            .to_string(true)
            .map_err(|e| Error::Tokenizer(e.to_string()))
    }

    /// Writes `tokenizer.json` into `dir` (so a saved checkpoint is self-contained).
    pub fn save(&self, dir: &Path) -> Result<()> {
        let path = dir.join("tokenizer.json");
        self.inner
            .save(&path, false)
            .map_err(|e| Error::Tokenizer(format!("{}: {e}", path.display())))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const START: &str = "P: rnbqkbnr/pppppppp/8/8/8/8/PPPPPPPP/RNBQKBNR w KQkq - 0 1    M:";

    #[test]
    fn hello_world_and_the_46_token_policy_prompt() {
        let tok = Tokenizer::gpt2();
        assert_eq!(tok.encode("Hello world").unwrap(), vec![15496, 995]);
        assert_eq!(
            tok.encode_prompt(50256, "Hello world").unwrap(),
            vec![50256, 15496, 995]
        );
        let ids = tok.encode(START).unwrap();
        assert_eq!(ids.len(), 46);
        assert_eq!(tok.decode(&ids).unwrap(), START);
    }

    #[test]
    fn vocab_and_merges_build_the_same_tokenizer() {
        use tokenizers::Model;
        let reference = Tokenizer::gpt2();
        let dir = tempfile::tempdir().unwrap();
        reference.inner.get_model().save(dir.path(), None).unwrap();
        let loaded = Tokenizer::from_dir(dir.path())
            .unwrap()
            .expect("vocab.json + merges.txt found");
        let tok = Tokenizer::from_vocab_merges(
            &dir.path().join("vocab.json"),
            &dir.path().join("merges.txt"),
        )
        .unwrap();
        assert_eq!(loaded.encode(START).unwrap(), tok.encode(START).unwrap());
        for text in [
            START,
            "Hello world",
            "A: 8/8/8/8/8/8/8/8 w - - 0 1+e2e4+",
            "  two  spaces\n",
        ] {
            assert_eq!(
                tok.encode(text).unwrap(),
                reference.encode(text).unwrap(),
                "{text:?}"
            );
        }
        assert_eq!(tok.encode("<|endoftext|>").unwrap(), vec![EOT_TOKEN]);
        assert_eq!(tok.vocab_size(), 50257);
    }
}
