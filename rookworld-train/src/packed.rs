//! A micro-batch of groups laid out as rows, the prompt once per group: what every
//! backend's pass reads (ids, positions, which rows attend to which, which rows predict).

use std::ops::Range;

/// A synthetic batch for tests and benches: `prompts` groups of `group` completions, each
/// prompt `prompt_tokens` long and each completion at most `completion_tokens` (a quarter
/// of each group's completions shorter, so that the layout has ragged rows), tokens below
/// `vocab`. Deterministic in `seed`.
pub fn synthetic(
    (prompts, group): (usize, usize),
    (prompt_tokens, completion_tokens): (usize, usize),
    vocab: usize,
    seed: u64,
) -> (Vec<Vec<u32>>, Vec<Vec<Vec<u32>>>) {
    let mut state = seed
        .wrapping_mul(6364136223846793005)
        .wrapping_add(1442695040888963407);
    let mut next = move || {
        state = state
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        ((state >> 33) % vocab.max(1) as u64) as u32
    };
    let p: Vec<Vec<u32>> = (0..prompts)
        .map(|_| (0..prompt_tokens).map(|_| next()).collect())
        .collect();
    let c = (0..prompts)
        .map(|_| {
            (0..group)
                .map(|j| {
                    let len = if j % 4 == 3 {
                        (completion_tokens / 2).max(1)
                    } else {
                        completion_tokens
                    };
                    (0..len).map(|_| next()).collect()
                })
                .collect()
        })
        .collect();
    (p, c)
}

/// A scatter `dst[index[i]] += src[i]` grouped by destination, so that a device sums each
/// destination's sources in a fixed order (no atomics, the same bits every run): the
/// distinct destinations in increasing order (`targets`), and for destination k its
/// sources `sources[offsets[k]..offsets[k + 1]]`, in increasing order.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ScatterPlan {
    pub targets: Vec<u32>,
    pub offsets: Vec<u32>,
    pub sources: Vec<u32>,
}

impl ScatterPlan {
    pub fn new(index: &[u32]) -> Self {
        let mut order: Vec<u32> = (0..index.len() as u32).collect();
        // Stable: equal destinations keep their sources in increasing order.
        order.sort_by_key(|&i| index[i as usize]);
        let mut plan = ScatterPlan {
            targets: Vec::new(),
            offsets: vec![0],
            sources: order,
        };
        for (n, &i) in plan.sources.iter().enumerate() {
            let t = index[i as usize];
            if plan.targets.last() != Some(&t) {
                if !plan.targets.is_empty() {
                    plan.offsets.push(n as u32);
                }
                plan.targets.push(t);
            }
        }
        plan.offsets.push(plan.sources.len() as u32);
        if plan.targets.is_empty() {
            plan.offsets = vec![0];
        }
        plan
    }

    /// `dst` (·, width) += the rows of `src` (index.len(), width) scattered by the plan,
    /// each destination's sources summed in order first: the reference of a device's
    /// planned scatter.
    pub fn apply(&self, dst: &mut [f32], src: &[f32], width: usize) {
        for (k, &t) in self.targets.iter().enumerate() {
            let range = self.offsets[k] as usize..self.offsets[k + 1] as usize;
            let row = &mut dst[t as usize * width..(t as usize + 1) * width];
            for c in 0..width {
                let s: f32 = self.sources[range.clone()]
                    .iter()
                    .map(|&i| src[i as usize * width + c])
                    .sum();
                row[c] += s;
            }
        }
    }
}

/// One group: its prompt and its completions.
#[derive(Debug, Clone, Copy)]
pub struct GroupInput<'a> {
    pub prompt: &'a [u32],
    pub completions: &'a [Vec<u32>],
}

/// A micro-batch of groups laid out as rows: per group its prompt's rows, then each
/// completion's rows (all of its tokens but the last).
#[derive(Debug, Clone)]
pub struct Packed {
    /// (R) token fed at each row, and its position.
    pub ids: Vec<u32>,
    pub positions: Vec<u32>,
    pub groups: Vec<GroupRows>,
    /// (N) the row whose hidden state predicts each completion token, and that token;
    /// completion after completion, in batch order.
    pub head_rows: Vec<u32>,
    pub targets: Vec<u32>,
    /// Per completion (batch order), its tokens' range in `head_rows`.
    pub tokens: Vec<std::ops::Range<usize>>,
}

impl Packed {
    /// The groups of prompts `prompts` and their completions `completions` (group g:
    /// `prompts[g]`, `completions[g]`), packed.
    pub fn of(prompts: &[Vec<u32>], completions: &[Vec<Vec<u32>>]) -> Self {
        let groups: Vec<GroupInput> = prompts
            .iter()
            .zip(completions)
            .map(|(prompt, completions)| GroupInput {
                prompt,
                completions,
            })
            .collect();
        Self::new(&groups)
    }

    pub fn new(groups: &[GroupInput]) -> Self {
        let mut p = Packed {
            ids: Vec::new(),
            positions: Vec::new(),
            groups: Vec::new(),
            head_rows: Vec::new(),
            targets: Vec::new(),
            tokens: Vec::new(),
        };
        for g in groups {
            let start = p.ids.len();
            p.ids.extend_from_slice(g.prompt);
            p.positions.extend(0..g.prompt.len() as u32);
            let prompt = start..p.ids.len();
            let last = (prompt.end - 1) as u32;
            let mut completions = Vec::new();
            for c in g.completions {
                let first = p.ids.len();
                let fed = &c[..c.len().saturating_sub(1)];
                p.ids.extend_from_slice(fed);
                let lp = g.prompt.len() as u32;
                p.positions.extend(lp..lp + fed.len() as u32);
                let n0 = p.head_rows.len();
                for (j, &y) in c.iter().enumerate() {
                    p.head_rows
                        .push(if j == 0 { last } else { (first + j - 1) as u32 });
                    p.targets.push(y);
                }
                p.tokens.push(n0..p.head_rows.len());
                completions.push(first..p.ids.len());
            }
            p.groups.push(GroupRows {
                prompt,
                completions,
            });
        }
        p
    }

    /// Rows fed.
    pub fn rows(&self) -> usize {
        self.ids.len()
    }

    /// Which rows attend to which, per row `(p0, p1, o0, q_end)`: as a query, row r sees
    /// the prefix rows `p0..p1` (its group's prompt, for a completion row; none for a
    /// prompt row) and its own rows `o0..=r`; as a key, row r is seen by the query rows
    /// `r..q_end` (the rest of its group for a prompt row, of its completion otherwise).
    /// The layout the attention kernels of a GPU backend read, one fixed-size record a
    /// row, in place of the groups' ranges.
    pub fn row_meta(&self) -> Vec<[i32; 4]> {
        let mut meta = vec![[0i32; 4]; self.rows()];
        for g in &self.groups {
            let start = g.prompt.start as i32;
            let group_end = g.completions.last().map_or(g.prompt.end, |c| c.end) as i32;
            for row in g.prompt.clone() {
                meta[row] = [start, start, start, group_end];
            }
            for c in &g.completions {
                for row in c.clone() {
                    meta[row] = [start, g.prompt.end as i32, c.start as i32, c.end as i32];
                }
            }
        }
        meta
    }

    /// The rows cut into tiles of at most `max` consecutive rows that share their
    /// [`row_meta`](Self::row_meta) — a prompt's, or one completion's — each `[first row,
    /// rows]`, in row order: the blocks of a tiled attention kernel, whose rows see the
    /// same prefix and, as keys, are seen up to the same row.
    pub fn row_tiles(&self, max: usize) -> Vec<[i32; 2]> {
        let max = max.max(1);
        let mut tiles = Vec::new();
        for g in &self.groups {
            for segment in std::iter::once(&g.prompt).chain(&g.completions) {
                for first in segment.clone().step_by(max) {
                    let rows = max.min(segment.end - first);
                    tiles.push([first as i32, rows as i32]);
                }
            }
        }
        tiles
    }
}

/// The rows of one group in the packed batch.
#[derive(Debug, Clone)]
pub struct GroupRows {
    pub prompt: Range<usize>,
    pub completions: Vec<Range<usize>>,
}

impl GroupRows {
    /// Attention probabilities one head keeps for this group: the prompt's (Lp, Lp)
    /// block and each completion's (n, Lp + n) block.
    pub fn probs_len(&self) -> usize {
        let lp = self.prompt.len();
        lp * lp
            + self
                .completions
                .iter()
                .map(|c| c.len() * (lp + c.len()))
                .sum::<usize>()
    }

    /// The segments of this group: (visible prefix rows, own rows, offset in the head's
    /// probabilities).
    pub(crate) fn segments(&self) -> Vec<(Range<usize>, Range<usize>, usize)> {
        let lp = self.prompt.len();
        let mut out = vec![(0..0, self.prompt.clone(), 0)];
        let mut offset = lp * lp;
        for c in &self.completions {
            out.push((self.prompt.clone(), c.clone(), offset));
            offset += c.len() * (lp + c.len());
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_planned_scatter_adds_every_source_to_its_destination_once() {
        let index = [3u32, 0, 3, 7, 0, 3, 5];
        let plan = ScatterPlan::new(&index);
        assert_eq!(plan.targets, [0, 3, 5, 7]);
        assert_eq!(plan.offsets, [0, 2, 5, 6, 7]);
        assert_eq!(plan.sources, [1, 4, 0, 2, 5, 6, 3]);
        // Integer values: every order of summation gives the same sums.
        let width = 3;
        let src: Vec<f32> = (0..index.len() * width).map(|v| v as f32).collect();
        let mut want = vec![1f32; 8 * width];
        for (i, &t) in index.iter().enumerate() {
            for c in 0..width {
                want[t as usize * width + c] += src[i * width + c];
            }
        }
        let mut got = vec![1f32; 8 * width];
        plan.apply(&mut got, &src, width);
        assert_eq!(got, want);
        let empty = ScatterPlan::new(&[]);
        assert_eq!(
            (empty.targets.len(), empty.offsets.as_slice()),
            (0, &[0u32][..])
        );
    }

    /// The rows query row r sees through [`Packed::row_meta`].
    fn seen_by(meta: &[[i32; 4]], r: usize) -> Vec<usize> {
        let [p0, p1, o0, _] = meta[r].map(|v| v as usize);
        (p0..p1).chain(o0..=r).collect()
    }

    #[test]
    fn each_row_sees_its_own_sequence_and_each_key_is_seen_by_its_query_range() {
        let prompts = [vec![1, 2, 3, 4], vec![5, 6]];
        let completions = [
            vec![vec![7, 8, 9], vec![10], vec![11, 12]],
            vec![vec![13, 14, 15, 16], vec![17, 18]],
        ];
        let packed = Packed::of(&prompts, &completions);
        let meta = packed.row_meta();
        // Each row's positions are 0.. of its own `prompt ++ completion` sequence, so the
        // rows it sees are exactly those of positions 0..=its own.
        for r in 0..packed.rows() {
            let seen = seen_by(&meta, r);
            let positions: Vec<u32> = seen.iter().map(|&k| packed.positions[k]).collect();
            assert_eq!(
                positions,
                (0..=packed.positions[r]).collect::<Vec<_>>(),
                "row {r}"
            );
        }
        // As a key, row j is seen by exactly the queries j..q_end.
        for j in 0..packed.rows() {
            let by: Vec<usize> = (0..packed.rows())
                .filter(|&r| seen_by(&meta, r).contains(&j))
                .collect();
            assert_eq!(by, (j..meta[j][3] as usize).collect::<Vec<_>>(), "key {j}");
        }
    }

    #[test]
    fn tiles_cover_every_row_once_and_share_what_their_rows_see() {
        let prompts = [vec![1, 2, 3, 4, 5], vec![6, 7]];
        let completions = [
            vec![vec![7, 8, 9, 10, 11, 12], vec![10], vec![11, 12, 13]],
            vec![vec![13, 14, 15, 16], vec![17, 18]],
        ];
        let packed = Packed::of(&prompts, &completions);
        let meta = packed.row_meta();
        for max in [1, 2, 3, 32] {
            let tiles = packed.row_tiles(max);
            let mut next = 0;
            for &[first, rows] in &tiles {
                let (first, rows) = (first as usize, rows as usize);
                assert_eq!(first, next, "in row order, every row once (max {max})");
                assert!((1..=max).contains(&rows), "max {max}");
                // Every row of a tile sees the same prefix and its own rows from the same
                // start, and is seen as a key up to the same row.
                for r in first..first + rows {
                    assert_eq!(meta[r], meta[first], "row {r} of tile {first} (max {max})");
                }
                next = first + rows;
            }
            assert_eq!(next, packed.rows(), "max {max}");
        }
        // A prompt of 5 in tiles of 2: 2, 2, 1; then each completion on its own.
        let tiles = packed.row_tiles(2);
        assert_eq!(tiles[..4], [[0, 2], [2, 2], [4, 1], [5, 2]]);
    }
}
