//! Task boundaries: a panic inside a task becomes a value its caller can act on (requeue the
//! requests it held, restart the task), never a silent end of the task.

use std::future::Future;
use std::panic::AssertUnwindSafe;
use std::time::Duration;

use futures_util::FutureExt;
use tokio_util::sync::CancellationToken;
use tracing::error;

/// Runs `fut`, turning a panic into its message (the payload of `panic!` with a message, or
/// "a panic without a message").
///
/// A combinator, not an `async fn`: an `async fn` keeps its future argument and, once awaiting
/// it, a second copy of it, so every wrapped task would be twice its size (and each spawn and
/// move would copy both).
pub fn catch_panic<F: Future>(fut: F) -> impl Future<Output = Result<F::Output, String>> {
    AssertUnwindSafe(fut).catch_unwind().map(|r| {
        r.map_err(|p| match (p.downcast_ref::<&str>(), p.downcast_ref::<String>()) {
            (Some(s), _) => (*s).to_owned(),
            (None, Some(s)) => s.clone(),
            (None, None) => "a panic without a message".to_owned(),
        })
    })
}

/// Sleeps until `deadline`, or forever when there is none.
pub async fn sleep_until_some(deadline: Option<tokio::time::Instant>) {
    match deadline {
        Some(deadline) => tokio::time::sleep_until(deadline).await,
        None => std::future::pending().await,
    }
}

/// Runs the task `start` makes until it returns or `stop` fires; after a panic (logged at ERROR
/// naming `what`, then reported to `panicked`, e.g. to count it) starts it again `wait` later.
pub async fn restart_after_panic<F, Fut>(what: &str, wait: Duration, stop: &CancellationToken, panicked: impl Fn(), mut start: F)
where
    F: FnMut() -> Fut,
    Fut: Future<Output = ()>,
{
    while let Err(panic) = catch_panic(start()).await {
        error!(panic = %panic, retry_in = ?wait, "{what} panicked; starting it again");
        panicked();
        tokio::select! {
            _ = stop.cancelled() => return,
            _ = tokio::time::sleep(wait) => {}
        }
    }
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::AtomicU32;
    use std::sync::atomic::Ordering::SeqCst;

    use super::*;

    #[tokio::test]
    async fn catch_panic_returns_the_message() {
        assert_eq!(catch_panic(async { 3 }).await, Ok(3));
        let got = catch_panic(async { panic!("boom {}", 1) }).await;
        assert_eq!(got, Err::<(), _>("boom 1".to_owned()));
        let got = catch_panic(async { std::panic::panic_any(5u8) }).await;
        assert_eq!(got, Err::<(), _>("a panic without a message".to_owned()));
    }

    #[tokio::test(start_paused = true)]
    async fn a_panicked_task_starts_again_after_the_wait_until_it_returns() {
        let (starts, panics) = (AtomicU32::new(0), AtomicU32::new(0));
        let t0 = tokio::time::Instant::now();
        let panicked = || {
            panics.fetch_add(1, SeqCst);
        };
        restart_after_panic("the test task", Duration::from_secs(1), &CancellationToken::new(), panicked, || async {
            if starts.fetch_add(1, SeqCst) < 2 {
                panic!("not yet");
            }
        })
        .await;
        assert_eq!(starts.load(SeqCst), 3);
        assert_eq!(t0.elapsed(), Duration::from_secs(2), "one wait after each of the two panics");
        assert_eq!(panics.load(SeqCst), 2);
    }

    #[tokio::test(start_paused = true)]
    async fn a_stop_during_the_wait_ends_it() {
        let stop = CancellationToken::new();
        let starts = AtomicU32::new(0);
        let stopper = stop.clone();
        tokio::spawn(async move {
            tokio::time::sleep(Duration::from_millis(500)).await;
            stopper.cancel();
        });
        restart_after_panic("the test task", Duration::from_secs(60), &stop, || {}, || async {
            starts.fetch_add(1, SeqCst);
            panic!("always");
        })
        .await;
        assert_eq!(starts.load(SeqCst), 1);
    }
}
