//! The built-in tokenizer reproduces the real RookWorld training shard exactly.

use std::collections::HashMap;

use rookworld_lm::{EOT_TOKEN, Tokenizer};
use rookworld_tests::fixture;

/// Documents of an llm.c token shard: int32[256] header (magic 20240520, version 1,
/// token count) then uint16 tokens, each document preceded by end-of-text.
fn shard_documents(bytes: &[u8]) -> Vec<Vec<u32>> {
    let header: Vec<i32> = bytes[..1024]
        .chunks(4)
        .map(|c| i32::from_le_bytes(c.try_into().unwrap()))
        .collect();
    assert_eq!((header[0], header[1]), (20240520, 1), "llm.c shard header");
    let tokens: Vec<u32> = bytes[1024..]
        .chunks(2)
        .map(|c| u16::from_le_bytes([c[0], c[1]]) as u32)
        .collect();
    assert_eq!(tokens.len(), header[2] as usize, "token count in header");
    assert_eq!(tokens[0], EOT_TOKEN);
    tokens
        .split(|&t| t == EOT_TOKEN)
        .skip(1)
        .map(<[u32]>::to_vec)
        .collect()
}

#[test]
fn every_document_of_rook_val_500_encodes_to_the_shards_ids() {
    let bytes = std::fs::read(fixture("rookworld/rook_val_500.bin")).unwrap();
    let docs = shard_documents(&bytes);
    let text = std::fs::read_to_string(fixture("rookworld/rook_val_500.txt")).unwrap();
    let lines: Vec<&str> = text.lines().collect();
    assert_eq!((docs.len(), lines.len()), (500, 500));

    let tok = Tokenizer::gpt2();
    // The shard holds the same lines in another order, each followed by "\n" except the
    // .txt's last line, which has no newline in the file either (the data as published).
    // Every document must be exactly the encoding of one line (+ "\n"), each line once.
    assert!(!text.ends_with('\n'));
    let last_line = *lines.last().unwrap();
    let mut unused: HashMap<&str, usize> = HashMap::new();
    for line in &lines {
        *unused.entry(line).or_default() += 1;
    }
    for (k, doc) in docs.iter().enumerate() {
        let decoded = tok.decode(doc).unwrap();
        let line = match decoded.strip_suffix('\n') {
            Some(line) => line,
            None if decoded == last_line => decoded.as_str(),
            None => panic!("document {k} lacks its trailing newline: {decoded:?}"),
        };
        let left = unused
            .get_mut(line)
            .unwrap_or_else(|| panic!("document {k} is no line of the .txt: {line:?}"));
        assert!(*left > 0, "line used twice: {line:?}");
        *left -= 1;
        let text = if decoded.ends_with('\n') {
            format!("{line}\n")
        } else {
            line.to_owned()
        };
        assert_eq!(tok.encode(&text).unwrap(), *doc, "document {k}: {text:?}");
    }
    assert!(unused.values().all(|&n| n == 0));
}

#[test]
fn the_46_token_policy_prompt_and_a_model_directory_s_tokenizer_file() {
    let prompt = "P: rnbqkbnr/pppppppp/8/8/8/8/PPPPPPPP/RNBQKBNR w KQkq - 0 1    M:";
    assert_eq!(Tokenizer::gpt2().encode(prompt).unwrap().len(), 46);
    // A checkpoint directory's tokenizer.json (here the embedded file, as a converted
    // checkpoint carries it) loads to the same tokenizer.
    let dir = tempfile::tempdir().unwrap();
    let embedded = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../rookworld-lm/assets/gpt2-tokenizer.json");
    std::fs::copy(embedded, dir.path().join("tokenizer.json")).unwrap();
    let tok = Tokenizer::from_dir(dir.path())
        .unwrap()
        .expect("tokenizer.json");
    assert_eq!(
        tok.encode(prompt).unwrap(),
        Tokenizer::gpt2().encode(prompt).unwrap()
    );
}
