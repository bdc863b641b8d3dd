//! `learner init`: write a starting checkpoint in Hugging Face GPT-2 layout
//! (`config.json`, `model.safetensors`, `tokenizer.json`), from a preset's seeded random
//! weights or by converting another checkpoint (e.g. to bf16).

use std::path::PathBuf;

use rookworld_lm::Result;
use rookworld_lm::cli::ModelArgs;
use rookworld_lm::device::parse_dtype;
use rookworld_lm::model_io;

/// Options of `learner init`.
#[derive(Debug, Clone, clap::Args)]
pub struct InitArgs {
    #[command(flatten)]
    pub model: ModelArgs,
    /// Directory to write the checkpoint into (created if needed).
    #[arg(long, value_name = "DIR")]
    pub out: PathBuf,
    /// dtype of the saved weights: f32, f16 or bf16.
    #[arg(long, default_value = "f32")]
    pub save_dtype: String,
}

/// Loads or builds the model and saves it under `args.out`.
pub fn run(args: &InitArgs) -> Result<()> {
    let save_dtype = parse_dtype(&args.save_dtype)?;
    let loaded = args.model.load()?;
    model_io::save(&loaded.model, &args.out, save_dtype)?;
    loaded.tokenizer.save(&args.out)?;
    tracing::info!(
        source = %loaded.source,
        out = %args.out.display(),
        dtype = ?save_dtype,
        parameters = loaded.model.config().num_parameters(),
        "checkpoint written"
    );
    Ok(())
}
