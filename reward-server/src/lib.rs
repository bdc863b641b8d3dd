//! The reward server: verifies RookWorld completions (shakmaty, optionally Stockfish).
//!
//! The scoring library, gRPC service and CLI arrive with the reward-server issue.
