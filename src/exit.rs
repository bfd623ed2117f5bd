//! Process exit codes, all in one place.
//!
//! Codes 64–78 come from BSD `sysexits.h` (`EX_SOFTWARE`, `EX_CONFIG`); 0 and 1 are the C
//! `EXIT_SUCCESS` / `EXIT_FAILURE`. The systemd unit names [`EX_CONFIG`] in
//! `RestartPreventExitStatus`, so a bad configuration does not restart-loop.

/// Success (`EX_OK`, sysexits.h): the daemon drained and stopped, or a command finished.
pub const EX_OK: u8 = 0;
/// Any other fatal error (`EXIT_FAILURE`): e.g. the HTTP port cannot be bound, or the AMQP
/// connection failed during the drain (the drain did not complete, but a longer
/// `shutdown.drain_timeout` would not have helped, so it is not [`EX_SOFTWARE`]).
pub const EX_FAILURE: u8 = 1;
/// `submit --wait`: some requests got no result before `--timeout`.
pub const EX_MISSING_RESULTS: u8 = 3;
/// `status`: Redis holds no member, lease or partition count under `redis.key_prefix` (a
/// mistyped prefix or Redis URL, or a deployment whose keys were deleted or lost).
pub const EX_NO_DEPLOYMENT: u8 = 4;
/// `status`: the table was printed from Redis, but no RabbitMQ node answered, so the backlog
/// and consumer columns are unknown; `submit`: no RabbitMQ node answered (`EX_UNAVAILABLE`,
/// sysexits.h: "a service is unavailable").
pub const EX_UNAVAILABLE: u8 = 69;
/// `submit`: the input file cannot be opened or read (`EX_NOINPUT`, sysexits.h: "an input file
/// did not exist or was not readable").
pub const EX_NOINPUT: u8 = 66;
/// `submit --wait`: the results file cannot be created or written (`EX_CANTCREAT`, sysexits.h:
/// "a (user specified) output file cannot be created").
pub const EX_CANTCREAT: u8 = 73;
/// The drain did not finish within `shutdown.drain_timeout` (`EX_SOFTWARE`, sysexits.h:
/// "an internal software error"); unfinished requests return to their queues.
pub const EX_SOFTWARE: u8 = 70;
/// `status`: a RabbitMQ node answered but refused the login or the vhost (`EX_NOPERM`,
/// sysexits.h: "insufficient permission"); the table is printed from Redis, backlog unknown.
/// `submit`: the same refusal.
pub const EX_NOPERM: u8 = 77;
/// `check-config`, `status`: their output could not be written (`EX_IOERR`, sysexits.h: "an
/// error occurred while doing I/O on some file"), e.g. a full disk behind a redirect. A reader
/// that stopped reading (`… | head -1`) is not an error.
pub const EX_IOERR: u8 = 74;
/// A bad configuration, or a deployment that does not match it (`EX_CONFIG`, sysexits.h).
pub const EX_CONFIG: u8 = 78;

/// `eprintln!` that never panics: a message to a standard error that cannot be written (a full
/// disk behind `2>file`, a closed journal socket) is dropped, so the process still ends with the
/// exit code the message explains (78 for a bad configuration) instead of a panic's 101.
#[macro_export]
macro_rules! report {
    ($($arg:tt)*) => {{
        use std::io::Write as _;
        let _ = writeln!(std::io::stderr(), $($arg)*);
    }};
}
