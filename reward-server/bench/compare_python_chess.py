#!/usr/bin/env python3
"""Reward-server speed against python-chess, and agreement with python-chess.

    cargo build --release -p reward-server
    python3 -m pip install chess
    python3 reward-server/bench/compare_python_chess.py [--items 50000] [--agree 20000]

1. Speed: `reward-server bench --write-items` generates seeded random items and times
   them through the scoring code path (one thread, all cores); this script then times
   python-chess, single-threaded, doing the same verification on the same items:
   - A-check: parse the prompt, Board(fen), check the move is legal, push it, board.fen()
     and board.outcome(), compare with the completion's four fields;
   - P-check: Board(fen), find the M:/E:/B: sections, check every move and the best move
     for legality.
   Both run in this one invocation on this machine; the ratios are printed.
2. Agreement: python-chess plays random games (its own seeded RNG), picks a random legal
   move, and writes the A-task line with *its* truth (new FEN with the en passant square
   only when a capture is legal, reward, terminated, truncated). `reward-server score`
   must call every one of them exact.
"""
import argparse
import json
import os
import random
import subprocess
import sys
import tempfile
import time

import chess

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def a_check(prompt, completion):
    fen, uci, _history = prompt[3:].rstrip("+").split("+")
    board = chess.Board(fen)
    move = chess.Move.from_uci(uci)
    if not board.is_legal(move):
        return False
    board.push(move)
    outcome = board.outcome()
    reward = 0.001 if outcome is None else (1.0 if outcome.winner is not None else 0.5)
    fields = completion.split("+")
    return (
        len(fields) == 4
        and fields[0] == board.fen()
        and float(fields[1]) == reward
        and fields[2] == ("1" if outcome else "0")
        and fields[3] == "0"
    )


def p_check(prompt, completion):
    board = chess.Board(prompt[3:].strip())
    m = completion.index("M:")
    e = completion.index("E:", m)
    b = completion.index("B:", e)
    moves = completion[m + 2:e].split()
    best = completion[b + 2:].split()
    legal = [board.is_legal(chess.Move.from_uci(u)) for u in moves]
    return all(legal) and len(best) == 1 and board.is_legal(chess.Move.from_uci(best[0]))


def time_python(items, check, repeat):
    best = float("inf")
    for _ in range(repeat):
        start = time.perf_counter()
        ok = sum(check(i["prompt"], i["completion"]) for i in items)
        best = min(best, time.perf_counter() - start)
        assert ok == len(items), f"python-chess rejected {len(items) - ok} items"
    return len(items) / best


def random_env_line(rng, max_plies):
    board = chess.Board()
    history = []
    for _ in range(rng.randint(0, max_plies)):
        moves = list(board.legal_moves)
        move = rng.choice(moves)
        board.push(move)
        if board.is_game_over():
            board.pop()
            break
        history.append(move.uci())
    fen = board.fen()
    move = rng.choice(list(board.legal_moves))
    history.append(move.uci())
    board = chess.Board(fen)  # no move stack: repetition is undecidable for both sides
    board.push(move)
    outcome = board.outcome()
    reward = "0.001" if outcome is None else ("1.0" if outcome.winner is not None else "0.5")
    prompt = f"A: {fen}+{move.uci()}+{' '.join(history[-10:])}+"
    completion = f"{board.fen()}+{reward}+{1 if outcome else 0}+0"
    return {"task": "A", "prompt": prompt, "completion": completion}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--binary", default=os.path.join(ROOT, "target", "release", "reward-server"))
    ap.add_argument("--items", type=int, default=50000)
    ap.add_argument("--agree", type=int, default=20000)
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()

    with tempfile.TemporaryDirectory() as tmp:
        items_path = os.path.join(tmp, "items.jsonl")
        out = subprocess.run(
            [args.binary, "bench", "--items", str(args.items), "--seed", str(args.seed),
             "--repeat", str(args.repeat), "--write-items", items_path],
            check=True, capture_output=True, text=True,
        )
        rust = json.loads(out.stdout)
        items = [json.loads(l) for l in open(items_path)]
        env = [i for i in items if i["task"] == "A"]
        pol = [i for i in items if i["task"] == "P"]
        py_env = time_python(env, a_check, args.repeat)
        py_pol = time_python(pol, p_check, args.repeat)

        rows = [
            ("A-task (environment)", py_env, rust["environment_per_second"]),
            ("P-task (policy, no engine)", py_pol, rust["policy_per_second"]),
        ]
        print(f"python-chess {chess.__version__}, python {sys.version.split()[0]}, "
              f"{args.items} items per task, {rust['cores']} cores, best of {args.repeat}")
        print(f"{'check':28} {'python-chess/s':>15} {'rust 1 thread/s':>16} {'ratio':>7} {'rust all cores/s':>17} {'ratio':>7}")
        for name, py, r in rows:
            print(f"{name:28} {py:15,.0f} {r['one_thread']:16,.0f} {r['one_thread'] / py:6.1f}x "
                  f"{r['all_cores']:17,.0f} {r['all_cores'] / py:6.1f}x")

        if args.agree:
            rng = random.Random(args.seed)
            # Half short games, half long ones (long random games reach bare kings,
            # the 75-move rule, stalemates and promotions far more often).
            lines = [random_env_line(rng, 120 if k % 2 else 600) for k in range(args.agree)]
            agree_path = os.path.join(tmp, "agree.jsonl")
            with open(agree_path, "w") as f:
                for l in lines:
                    f.write(json.dumps(l) + "\n")
            out = subprocess.run([args.binary, "score", "--input", agree_path], check=True, capture_output=True, text=True)
            results = [json.loads(l) for l in out.stdout.splitlines()]
            assert len(results) == len(lines)
            bad = [(l, r) for l, r in zip(lines, results) if r.get("verdict") != "exact"]
            endings = sum(1 for l in lines if not l["completion"].endswith("+0.001+0+0"))
            ep = sum(1 for l in lines if l["completion"].split("+")[0].split(" ")[3] != "-")
            print(f"agreement: {len(lines) - len(bad)}/{len(lines)} python-chess truths scored exact "
                  f"({ep} with an en passant square, {endings} game endings)")
            for l, r in bad[:5]:
                print("DISAGREE", json.dumps(l), json.dumps(r))
            if bad:
                sys.exit(1)


if __name__ == "__main__":
    main()
