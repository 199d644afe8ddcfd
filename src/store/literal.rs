//! Values written into SQL text, for the statements that travel with `BEGIN` and `COMMIT`.
//!
//! Several statements sent as one exchange go through the database's text protocol, which
//! takes no bind parameters, so a claim or a record sent that way carries its values in the
//! statement itself. Every byte string and every text is written as hexadecimal digits and
//! decoded by the database, never quoted: whatever a principal, a route or a body holds
//! (quotes, backslashes, NUL, comment markers), the only characters it adds to the statement
//! are `0-9a-f`, so it cannot end its literal early. Integers are written by Rust's formatter.

use std::fmt::Write;

/// How the database spells a decoded literal.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Syntax {
    /// `decode('…', 'hex')`, independent of `standard_conforming_strings`.
    #[cfg(feature = "postgres")]
    Postgres,
    /// `X'…'`, independent of `sql_mode` (`NO_BACKSLASH_ESCAPES`, `ANSI_QUOTES`).
    #[cfg(feature = "mysql")]
    MySql,
}

/// SQL text with values written in as literals: consecutive values are separated by commas,
/// as in a `VALUES (…)` list or a call's arguments.
#[derive(Debug)]
pub(crate) struct Literals {
    syntax: Syntax,
    sql: String,
    // Whether the last thing written was a value, which the next value follows after a comma.
    after_value: bool,
}

impl Literals {
    pub(crate) fn new(syntax: Syntax) -> Self {
        Self {
            syntax,
            sql: String::with_capacity(512),
            after_value: false,
        }
    }

    /// Statement text of this crate's own, written as it is.
    pub(crate) fn sql(&mut self, text: &'static str) -> &mut Self {
        self.sql.push_str(text);
        self.after_value = false;
        self
    }

    fn separate(&mut self) {
        if self.after_value {
            self.sql.push_str(", ");
        }
        self.after_value = true;
    }

    fn hex(&mut self, value: &[u8]) {
        const DIGITS: &[u8; 16] = b"0123456789abcdef";
        self.sql.reserve(value.len() * 2);
        for byte in value {
            self.sql.push(char::from(DIGITS[usize::from(byte >> 4)]));
            self.sql.push(char::from(DIGITS[usize::from(byte & 0x0f)]));
        }
    }

    /// A byte string.
    pub(crate) fn bytes(&mut self, value: &[u8]) -> &mut Self {
        self.separate();
        match self.syntax {
            #[cfg(feature = "postgres")]
            Syntax::Postgres => {
                self.sql.push_str("decode('");
                self.hex(value);
                self.sql.push_str("', 'hex')");
            }
            #[cfg(feature = "mysql")]
            Syntax::MySql => {
                self.sql.push_str("X'");
                self.hex(value);
                self.sql.push('\'');
            }
        }
        self
    }

    /// A text, in UTF-8.
    pub(crate) fn text(&mut self, value: &str) -> &mut Self {
        self.separate();
        match self.syntax {
            #[cfg(feature = "postgres")]
            Syntax::Postgres => {
                self.sql.push_str("convert_from(decode('");
                self.hex(value.as_bytes());
                self.sql.push_str("', 'hex'), 'UTF8')");
            }
            // The introducer makes the bytes text in utf8mb4, whatever the connection's
            // character set.
            #[cfg(feature = "mysql")]
            Syntax::MySql => {
                self.sql.push_str("_utf8mb4 X'");
                self.hex(value.as_bytes());
                self.sql.push('\'');
            }
        }
        self
    }

    /// An integer.
    pub(crate) fn int(&mut self, value: i64) -> &mut Self {
        self.separate();
        // Writing into a String cannot fail.
        let _ = write!(self.sql, "{value}");
        self
    }

    /// `NULL`.
    pub(crate) fn null(&mut self) -> &mut Self {
        self.separate();
        self.sql.push_str("NULL");
        self
    }

    /// A byte string, or `NULL`.
    pub(crate) fn opt_bytes(&mut self, value: Option<&[u8]>) -> &mut Self {
        match value {
            Some(value) => self.bytes(value),
            None => self.null(),
        }
    }

    /// A text, or `NULL`.
    pub(crate) fn opt_text(&mut self, value: Option<&str>) -> &mut Self {
        match value {
            Some(value) => self.text(value),
            None => self.null(),
        }
    }

    /// An integer, or `NULL`.
    pub(crate) fn opt_int(&mut self, value: Option<i64>) -> &mut Self {
        match value {
            Some(value) => self.int(value),
            None => self.null(),
        }
    }

    /// The text written so far.
    pub(crate) fn as_str(&self) -> &str {
        &self.sql
    }

    /// The text written.
    pub(crate) fn into_string(self) -> String {
        self.sql
    }
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;

    use super::{Literals, Syntax};

    /// What a value may add to a statement: hexadecimal digits inside the literal's own
    /// delimiters, nothing else.
    fn only_hex_between(sql: &str, open: &str, close: &str) -> bool {
        let mut rest = sql;
        while let Some(start) = rest.find(open) {
            let after = &rest[start + open.len()..];
            let Some(end) = after.find(close) else {
                return false;
            };
            if !after[..end].bytes().all(|b| b.is_ascii_hexdigit()) {
                return false;
            }
            rest = &after[end + close.len()..];
        }
        true
    }

    /// Each syntax, with the delimiters around a literal's digits and how many quotes a text
    /// and a byte string add.
    fn syntaxes() -> Vec<(Syntax, &'static str, &'static str, usize, usize)> {
        vec![
            #[cfg(feature = "postgres")]
            (Syntax::Postgres, "decode('", "', 'hex')", 6, 4),
            #[cfg(feature = "mysql")]
            (Syntax::MySql, "X'", "'", 2, 2),
        ]
    }

    proptest! {
        #[test]
        fn a_text_adds_only_hex_digits_to_the_statement(value in any::<String>()) {
            for (syntax, open, close, quotes, _) in syntaxes() {
                let mut literals = Literals::new(syntax);
                literals.text(&value);
                let sql = literals.as_str();
                prop_assert!(only_hex_between(sql, open, close), "{sql}");
                prop_assert_eq!(sql.matches('\'').count(), quotes);
            }
        }

        #[test]
        fn bytes_add_only_hex_digits_to_the_statement(value in proptest::collection::vec(any::<u8>(), 0..512)) {
            for (syntax, open, close, _, quotes) in syntaxes() {
                let mut literals = Literals::new(syntax);
                literals.bytes(&value).int(-7).null();
                let sql = literals.as_str();
                prop_assert!(only_hex_between(sql, open, close), "{sql}");
                prop_assert_eq!(sql.matches('\'').count(), quotes);
                prop_assert!(sql.ends_with(", -7, NULL"));
            }
        }
    }

    #[cfg(feature = "postgres")]
    #[test]
    fn hostile_text_is_written_as_hex_for_postgres() {
        let mut literals = Literals::new(Syntax::Postgres);
        literals.text("a'); DROP TABLE t; --\\\0");
        assert_eq!(
            literals.as_str(),
            "convert_from(decode('6127293b2044524f50205441424c4520743b202d2d5c00', 'hex'), 'UTF8')"
        );
        let mut literals = Literals::new(Syntax::Postgres);
        literals
            .text("'")
            .bytes(b"")
            .opt_int(None)
            .sql(" WHERE k = ")
            .int(1);
        assert_eq!(
            literals.as_str(),
            "convert_from(decode('27', 'hex'), 'UTF8'), decode('', 'hex'), NULL WHERE k = 1"
        );
    }

    #[cfg(feature = "mysql")]
    #[test]
    fn hostile_text_is_written_as_hex_for_mysql() {
        let mut literals = Literals::new(Syntax::MySql);
        literals
            .text("a'); DROP TABLE t; --\\\0")
            .bytes(b"")
            .opt_text(None)
            .sql(" WHERE k = ")
            .int(1);
        assert_eq!(
            literals.as_str(),
            "_utf8mb4 X'6127293b2044524f50205441424c4520743b202d2d5c00', X'', NULL WHERE k = 1"
        );
    }
}
