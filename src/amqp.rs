//! AMQP 0-9-1 reply codes used across the crate, and the classification of a broker refusal by
//! its reply code (never by its text).
//!
//! Source of every code: the AMQP 0-9-1 specification, section "Constants"
//! (<https://www.rabbitmq.com/resources/specs/amqp0-9-1.pdf>), as generated into
//! `amq_protocol::protocol::constants` and `AMQPSoftError`.

use lapin::protocol::AMQPErrorKind;

/// `reply-success` (200): the code of a normal `channel.close` / `connection.close`.
pub const REPLY_SUCCESS: u16 = lapin::protocol::constants::REPLY_SUCCESS;
/// `not-found` (404, soft error): a passive declare of a queue that does not exist.
pub const NOT_FOUND: u16 = 404;
/// `precondition-failed` (406, soft error): a redeclare with other arguments.
pub const PRECONDITION_FAILED: u16 = 406;

/// The reply code of the `channel.close` or `connection.close` the broker sent, when `e` is
/// such a refusal; `None` for I/O and client-side errors.
pub fn reply_code(e: &lapin::Error) -> Option<u16> {
    match e.kind() {
        lapin::ErrorKind::ProtocolError(p) => Some(match p.kind() {
            AMQPErrorKind::Soft(s) => s.get_id(),
            AMQPErrorKind::Hard(h) => h.get_id(),
        }),
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use lapin::protocol::{AMQPError, AMQPErrorKind, AMQPSoftError};

    use super::*;

    #[test]
    fn reply_code_of_a_broker_refusal() {
        let refusal = AMQPError::new(AMQPErrorKind::Soft(AMQPSoftError::PRECONDITIONFAILED), "inequivalent arg".into());
        let e: lapin::Error = lapin::ErrorKind::ProtocolError(refusal).into();
        assert_eq!(reply_code(&e), Some(PRECONDITION_FAILED));
        let e: lapin::Error = lapin::ErrorKind::ProtocolError(AMQPError::new(AMQPErrorKind::Soft(AMQPSoftError::NOTFOUND), "no queue".into())).into();
        assert_eq!(reply_code(&e), Some(NOT_FOUND));
        let io: lapin::Error = std::io::Error::other("reset").into();
        assert_eq!(reply_code(&io), None);
        assert_eq!(REPLY_SUCCESS, 200);
    }
}
