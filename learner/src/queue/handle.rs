//! The rollout queue as a handle over the thread that owns it, as TGI keeps its request
//! queue: callers send commands, and the owner applies them one at a time in the order
//! they came, so no lock is shared and no caller can hold the queue while it awaits.
//! The queue's own logic stays synchronous with time passed in ([`Queue`]), tested
//! without clocks; the handle only carries commands to it.
//!
//! Async callers (the gRPC service, the weight sync, the training loop) await
//! [`QueueHandle::run`]; synchronous ones (a checkpoint written on a blocking thread,
//! tests) use [`QueueHandle::call`]. The owner ends when the last handle is dropped.

use std::sync::mpsc;

use super::Queue;

/// One command: a closure the owner applies to the queue.
type Command = Box<dyn FnOnce(&mut Queue) + Send>;

/// A cloneable handle on the rollout queue's owner.
#[derive(Debug, Clone)]
pub struct QueueHandle {
    commands: mpsc::Sender<Command>,
}

impl QueueHandle {
    /// Hands `queue` to a thread of its own, which applies every command sent through the
    /// returned handle (and its clones) in order.
    pub fn start(mut queue: Queue) -> Self {
        let (commands, rx) = mpsc::channel::<Command>();
        std::thread::Builder::new()
            .name("rollout-queue".into())
            .spawn(move || {
                while let Ok(command) = rx.recv() {
                    // A command that panics loses its answer (its caller panics in turn),
                    // never the queue: the next command finds it as the last one left it.
                    let applied = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                        command(&mut queue)
                    }));
                    if applied.is_err() {
                        tracing::error!("a rollout-queue command panicked; the queue goes on");
                    }
                }
            })
            .expect("spawn the rollout queue's thread");
        Self { commands }
    }

    /// Applies `f` to the queue after every command sent before it, and returns what it
    /// returns; waits without blocking the async runtime.
    pub async fn run<R: Send + 'static>(
        &self,
        f: impl FnOnce(&mut Queue) -> R + Send + 'static,
    ) -> R {
        let (tx, rx) = tokio::sync::oneshot::channel();
        self.send(Box::new(move |q| {
            let _ = tx.send(f(q));
        }));
        rx.await.expect("the rollout queue answers every command")
    }

    /// Waits (at most `timeout`) until no lease is outstanding: the groups in flight when
    /// a run stops come in; what is still leased then stays unfinished, kept for the next
    /// run.
    pub async fn drain(&self, timeout: std::time::Duration) {
        let started = std::time::Instant::now();
        loop {
            let leased = self.run(|q| q.depths().leased).await;
            if leased == 0 {
                return;
            }
            if started.elapsed() >= timeout {
                tracing::warn!(
                    leased,
                    "drain timed out; those prompts are kept for the next run"
                );
                return;
            }
            tokio::time::sleep(std::time::Duration::from_millis(50)).await;
        }
    }

    /// [`Self::run`] for synchronous code: blocks this thread until the owner has applied
    /// `f` (not to be called on an async runtime's thread outside `block_in_place`).
    pub fn call<R: Send + 'static>(&self, f: impl FnOnce(&mut Queue) -> R + Send + 'static) -> R {
        let (tx, rx) = mpsc::sync_channel(1);
        self.send(Box::new(move |q| {
            let _ = tx.send(f(q));
        }));
        rx.recv().expect("the rollout queue answers every command")
    }

    fn send(&self, command: Command) {
        self.commands
            .send(command)
            .expect("the rollout queue's thread runs while a handle exists");
    }
}

#[cfg(test)]
mod tests {
    use std::time::Instant;

    use super::*;
    use crate::queue::QueueConfig;

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn commands_from_many_callers_apply_in_order_and_a_panic_loses_only_its_answer() {
        let handle = QueueHandle::start(Queue::new(QueueConfig::default()));
        handle.run(|q| q.set_run("run-a")).await;
        let mut calls = tokio::task::JoinSet::new();
        for i in 0..8 {
            let h = handle.clone();
            calls.spawn(async move {
                h.run(move |q| {
                    q.refused_call("Lease", "no token", &format!("peer-{i}"), Instant::now())
                })
                .await
            });
        }
        while calls.join_next().await.is_some() {}
        assert_eq!(handle.run(|q| q.refused_calls().len()).await, 8);

        let h = handle.clone();
        let lost = tokio::spawn(async move { h.run(|_| -> () { panic!("a bad command") }).await });
        assert!(
            lost.await.is_err(),
            "the caller of a panicking command panics"
        );
        // The queue is still there, as it was.
        let (run, refused) = tokio::task::spawn_blocking(move || {
            handle.call(|q| (q.run_id().to_owned(), q.refused_calls().len()))
        })
        .await
        .unwrap();
        assert_eq!((run.as_str(), refused), ("run-a", 8));
    }
}
