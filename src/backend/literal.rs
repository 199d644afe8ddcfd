//! Statements that carry values, each written once and sent either way: with its values
//! written into its text, or with its values bound.
//!
//! Several statements sent as one exchange (a claim with `BEGIN`, a finish with `COMMIT`) go
//! through the database's text protocol, which takes no bind parameters, so they carry their
//! values in their text. A [`Statement`] is the only way this crate writes a value into SQL:
//! it takes typed values alone (bytes, text, integers, `NULL`) and writes every byte string in
//! hexadecimal digits the database decodes, and every text either so (MySQL, SQLite) or, on
//! PostgreSQL, in an escape string where a character other than printable ASCII, the quote and
//! the backslash is the escape `\U` and its code point's eight digits. Whatever a principal, a
//! route or a body holds (quotes, backslashes, NUL, comment markers), it never adds a quote or a
//! backslash of its own to the statement, so it cannot end its literal early. Integers are
//! written by Rust's formatter. The same statement renders with placeholders instead, for values
//! too large to be worth writing out.

use std::borrow::Cow;
use std::fmt::Write;

use sqlx::AssertSqlSafe;

/// How the database spells a decoded literal and a placeholder.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Syntax {
    /// Escape strings, `E'\\x…'` for bytes and `E'…'` for a text, `\U…` for each character
    /// that is not printable ASCII or is a quote or a backslash,
    /// independent of `standard_conforming_strings`; `$1`.
    #[cfg(feature = "postgres")]
    Postgres,
    /// `X'…'`, independent of `sql_mode` (`NO_BACKSLASH_ESCAPES`, `ANSI_QUOTES`); `?`.
    #[cfg(feature = "mysql")]
    MySql,
    /// `X'…'`; `?1`.
    #[cfg(feature = "sqlite")]
    Sqlite,
}

/// A value a statement carries; `None` is `NULL` of the value's type.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Value<'a> {
    Bytes(Option<Cow<'a, [u8]>>),
    Text(Option<Cow<'a, str>>),
    /// A 32-bit integer, for an `INTEGER` column or parameter.
    Int4(Option<i32>),
    /// A 64-bit integer, for a `BIGINT` column or parameter.
    Int8(Option<i64>),
}

#[derive(Debug)]
enum Part<'a> {
    Sql(&'static str),
    Value(Value<'a>),
}

/// One SQL statement: text of this crate's own and typed values. Consecutive values are
/// separated by commas, as in a `VALUES (…)` list or a call's arguments.
#[derive(Debug)]
pub(crate) struct Statement<'a> {
    syntax: Syntax,
    parts: Vec<Part<'a>>,
}

impl<'a> Statement<'a> {
    pub(crate) fn new(syntax: Syntax) -> Self {
        Self {
            syntax,
            parts: Vec::with_capacity(24),
        }
    }

    /// Statement text of this crate's own, written as it is.
    pub(crate) fn sql(&mut self, text: &'static str) -> &mut Self {
        self.parts.push(Part::Sql(text));
        self
    }

    fn value(&mut self, value: Value<'a>) -> &mut Self {
        self.parts.push(Part::Value(value));
        self
    }

    /// A byte string.
    pub(crate) fn bytes(&mut self, value: impl Into<Cow<'a, [u8]>>) -> &mut Self {
        self.value(Value::Bytes(Some(value.into())))
    }

    /// A byte string, or `NULL`.
    pub(crate) fn opt_bytes(&mut self, value: Option<impl Into<Cow<'a, [u8]>>>) -> &mut Self {
        self.value(Value::Bytes(value.map(Into::into)))
    }

    /// A text, in UTF-8.
    pub(crate) fn text(&mut self, value: impl Into<Cow<'a, str>>) -> &mut Self {
        self.value(Value::Text(Some(value.into())))
    }

    /// A text, or `NULL`.
    pub(crate) fn opt_text(&mut self, value: Option<impl Into<Cow<'a, str>>>) -> &mut Self {
        self.value(Value::Text(value.map(Into::into)))
    }

    /// A 32-bit integer, or `NULL`.
    pub(crate) fn opt_int4(&mut self, value: Option<i32>) -> &mut Self {
        self.value(Value::Int4(value))
    }

    /// A 64-bit integer.
    pub(crate) fn int8(&mut self, value: i64) -> &mut Self {
        self.value(Value::Int8(Some(value)))
    }

    /// A 64-bit integer, or `NULL`.
    pub(crate) fn opt_int8(&mut self, value: Option<i64>) -> &mut Self {
        self.value(Value::Int8(value))
    }

    /// The statement with its values written in, after `before` and followed by `after`:
    /// statements of this crate's own sent in the same exchange.
    pub(crate) fn inline(
        &self,
        before: &'static str,
        after: &'static str,
    ) -> AssertSqlSafe<String> {
        let mut sql = String::with_capacity(before.len() + after.len() + self.weight() * 2 + 256);
        sql.push_str(before);
        self.render(&mut sql, |sql, _, value| self.literal(sql, value));
        sql.push_str(after);
        AssertSqlSafe(sql)
    }

    /// The statement with a placeholder for each value, and the values to bind in order.
    pub(crate) fn bound(&self) -> (AssertSqlSafe<String>, Vec<&Value<'a>>) {
        let values: Vec<&Value<'a>> = self
            .parts
            .iter()
            .filter_map(|part| match part {
                Part::Value(value) => Some(value),
                Part::Sql(_) => None,
            })
            .collect();
        // Sized once: a record's statement runs to several hundred bytes, and this is on every
        // new key's path.
        let text: usize = self
            .parts
            .iter()
            .map(|part| match part {
                Part::Sql(text) => text.len(),
                Part::Value(_) => 0,
            })
            .sum();
        let mut sql = String::with_capacity(text + values.len() * PLACEHOLDER_WIDTH);
        self.render(&mut sql, |sql, number, _| match self.syntax {
            #[cfg(feature = "postgres")]
            Syntax::Postgres => {
                sql.push('$');
                decimal(sql, number);
            }
            // Unnumbered: MySQL binds its placeholders in order.
            #[cfg(feature = "mysql")]
            Syntax::MySql => {
                let _ = number;
                sql.push('?');
            }
            #[cfg(feature = "sqlite")]
            Syntax::Sqlite => {
                sql.push('?');
                decimal(sql, number);
            }
        });
        (AssertSqlSafe(sql), values)
    }

    /// The bytes its byte strings and texts hold.
    pub(crate) fn weight(&self) -> usize {
        self.parts
            .iter()
            .map(|part| match part {
                Part::Value(Value::Bytes(Some(bytes))) => bytes.len(),
                Part::Value(Value::Text(Some(text))) => text.len(),
                _ => 0,
            })
            .sum()
    }

    /// Writes the text, and each value (numbered from 1) through `value`.
    fn render<'s>(
        &'s self,
        sql: &mut String,
        mut value: impl FnMut(&mut String, usize, &'s Value<'a>),
    ) {
        let mut number = 0;
        let mut after_value = false;
        for part in &self.parts {
            match part {
                Part::Sql(text) => {
                    sql.push_str(text);
                    after_value = false;
                }
                Part::Value(v) => {
                    if after_value {
                        sql.push_str(", ");
                    }
                    number += 1;
                    value(sql, number, v);
                    after_value = true;
                }
            }
        }
    }

    fn literal(&self, sql: &mut String, value: &Value<'_>) {
        // Writing into a String cannot fail.
        match value {
            Value::Bytes(None) | Value::Text(None) | Value::Int4(None) | Value::Int8(None) => {
                sql.push_str("NULL");
            }
            Value::Int4(Some(value)) => {
                let _ = write!(sql, "{value}");
            }
            Value::Int8(Some(value)) => {
                let _ = write!(sql, "{value}");
            }
            Value::Bytes(Some(value)) => match self.syntax {
                // The escape string's `\\` is one backslash, so the literal is bytea's hex
                // input, `\x…`, whatever `standard_conforming_strings` says; untyped, it takes
                // the type of the parameter or column it meets, with no function to call.
                #[cfg(feature = "postgres")]
                Syntax::Postgres => {
                    sql.push_str("E'\\\\x");
                    hex(sql, value);
                    sql.push('\'');
                }
                #[cfg(feature = "mysql")]
                Syntax::MySql => {
                    sql.push_str("X'");
                    hex(sql, value);
                    sql.push('\'');
                }
                #[cfg(feature = "sqlite")]
                Syntax::Sqlite => {
                    sql.push_str("X'");
                    hex(sql, value);
                    sql.push('\'');
                }
            },
            Value::Text(Some(value)) => match self.syntax {
                // In an escape string only the quote and the backslash are special: printable
                // ASCII other than those two stands for itself, and every other character is
                // written as the escape `\UXXXXXXXX`, its code point, which the server turns
                // into its own encoding. Writing the common characters as themselves spares
                // the server's lexer most of the escapes.
                #[cfg(feature = "postgres")]
                Syntax::Postgres => {
                    sql.push_str("E'");
                    for character in value.chars() {
                        if plain_in_escape_string(character) {
                            sql.push(character);
                        } else {
                            let _ = write!(sql, "\\U{:08x}", u32::from(character));
                        }
                    }
                    sql.push('\'');
                }
                // The introducer makes the bytes text in utf8mb4, whatever the connection's
                // character set.
                #[cfg(feature = "mysql")]
                Syntax::MySql => {
                    sql.push_str("_utf8mb4 X'");
                    hex(sql, value.as_bytes());
                    sql.push('\'');
                }
                // SQLite keeps text as UTF-8 bytes, so the blob's bytes are the text's.
                #[cfg(feature = "sqlite")]
                Syntax::Sqlite => {
                    sql.push_str("CAST(X'");
                    hex(sql, value.as_bytes());
                    sql.push_str("' AS TEXT)");
                }
            },
        }
    }
}

/// Whether `character` may stand for itself inside a PostgreSQL escape string: printable ASCII
/// (the space included) other than the quote that would end the literal and the backslash that
/// would start an escape.
#[cfg(feature = "postgres")]
fn plain_in_escape_string(character: char) -> bool {
    (character.is_ascii_graphic() || character == ' ') && !matches!(character, '\'' | '\\')
}

/// Room for one placeholder and the separator before it (`, $123`), so that rendering a
/// statement with placeholders never grows its text.
const PLACEHOLDER_WIDTH: usize = 8;

/// Writes a placeholder's number, without the formatting machinery: statements are rendered on
/// every request.
#[cfg(any(feature = "postgres", feature = "sqlite"))]
fn decimal(sql: &mut String, number: usize) {
    let mut digits = [0_u8; 20];
    let mut at = digits.len();
    let mut rest = number;
    loop {
        at -= 1;
        // A remainder below ten is one ASCII digit.
        digits[at] = b'0' + (rest % 10) as u8;
        rest /= 10;
        if rest == 0 {
            break;
        }
    }
    for &digit in &digits[at..] {
        sql.push(char::from(digit));
    }
}

fn hex(sql: &mut String, value: &[u8]) {
    const DIGITS: &[u8; 16] = b"0123456789abcdef";
    sql.reserve(value.len() * 2);
    for byte in value {
        sql.push(char::from(DIGITS[usize::from(byte >> 4)]));
        sql.push(char::from(DIGITS[usize::from(byte & 0x0f)]));
    }
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;

    use super::{Statement, Syntax, Value};

    /// What a value may add to a statement: hexadecimal digits inside the literal's own
    /// delimiters, each group of them after `escape` where the syntax writes one, nothing else.
    fn only_hex_between(sql: &str, open: &str, close: &str, escape: &str) -> bool {
        let mut rest = sql;
        while let Some(start) = rest.find(open) {
            let after = &rest[start + open.len()..];
            let Some(end) = after.find(close) else {
                return false;
            };
            let digits = if escape.is_empty() {
                after[..end].to_owned()
            } else {
                after[..end].replace(escape, "")
            };
            if !digits.bytes().all(|b| b.is_ascii_hexdigit()) {
                return false;
            }
            rest = &after[end + close.len()..];
        }
        true
    }

    /// What PostgreSQL reads from the inside of an escape string this module writes: `\U` and
    /// eight hexadecimal digits is a code point, any other backslash is refused, and every
    /// other character is itself.
    #[cfg(feature = "postgres")]
    fn decode_escape_string(inner: &str) -> Option<String> {
        let mut decoded = String::new();
        let mut rest = inner;
        while let Some(character) = rest.chars().next() {
            if character == '\\' {
                let digits = rest.strip_prefix("\\U")?.get(..8)?;
                decoded.push(char::from_u32(u32::from_str_radix(digits, 16).ok()?)?);
                rest = &rest[10..];
            } else {
                decoded.push(character);
                rest = &rest[character.len_utf8()..];
            }
        }
        Some(decoded)
    }

    /// How each syntax delimits a literal's digits.
    struct Delimiters {
        syntax: Syntax,
        /// Around a text's digits, and what precedes each character's digits, where a text
        /// is written as digits.
        text: Option<(&'static str, &'static str, &'static str)>,
        /// Around a byte string's digits.
        bytes: (&'static str, &'static str),
    }

    fn syntaxes() -> Vec<Delimiters> {
        vec![
            // A text is written differently there: see the property of its own below.
            #[cfg(feature = "postgres")]
            Delimiters {
                syntax: Syntax::Postgres,
                text: None,
                bytes: ("E'\\\\x", "'"),
            },
            #[cfg(feature = "mysql")]
            Delimiters {
                syntax: Syntax::MySql,
                text: Some(("X'", "'", "")),
                bytes: ("X'", "'"),
            },
            #[cfg(feature = "sqlite")]
            Delimiters {
                syntax: Syntax::Sqlite,
                text: Some(("X'", "'", "")),
                bytes: ("X'", "'"),
            },
        ]
    }

    proptest! {
        #[test]
        fn a_text_adds_only_hex_digits_to_the_statement(value in any::<String>()) {
            for Delimiters { syntax, text, .. } in syntaxes() {
                let Some((open, close, escape)) = text else { continue };
                let mut statement = Statement::new(syntax);
                statement.text(value.as_str());
                let sql = statement.inline("", "").0;
                prop_assert!(only_hex_between(&sql, open, close, escape), "{sql}");
                prop_assert_eq!(sql.matches('\'').count(), 2);
            }
        }

        #[cfg(feature = "postgres")]
        #[test]
        fn a_text_is_an_escape_string_that_decodes_to_it_on_postgres(value in any::<String>()) {
            let mut statement = Statement::new(Syntax::Postgres);
            statement.text(value.as_str());
            let sql = statement.inline("", "").0;
            let inner = sql.strip_prefix("E'").and_then(|rest| rest.strip_suffix('\''));
            prop_assert!(inner.is_some(), "{sql}");
            let inner = inner.unwrap_or_default();
            prop_assert!(!inner.contains('\''), "{sql}");
            prop_assert_eq!(decode_escape_string(inner), Some(value));
        }

        #[test]
        fn bytes_add_only_hex_digits_to_the_statement(value in proptest::collection::vec(any::<u8>(), 0..512)) {
            for Delimiters { syntax, bytes: (open, close), .. } in syntaxes() {
                let mut statement = Statement::new(syntax);
                statement.bytes(value.as_slice()).int8(-7).opt_int4(None);
                let sql = statement.inline("", "").0;
                prop_assert!(only_hex_between(&sql, open, close, ""), "{sql}");
                prop_assert_eq!(sql.matches('\'').count(), 2);
                prop_assert!(sql.ends_with(", -7, NULL"));
            }
        }

        #[test]
        fn bound_values_never_reach_the_text(value in any::<String>()) {
            for Delimiters { syntax, .. } in syntaxes() {
                let mut statement = Statement::new(syntax);
                statement.sql("SELECT f(").text(value.as_str()).bytes(value.as_bytes()).sql(")");
                let (sql, values) = statement.bound();
                prop_assert!(!sql.0.contains('\''), "{}", sql.0);
                prop_assert_eq!(values.len(), 2);
                prop_assert_eq!(values[0], &Value::Text(Some(value.as_str().into())));
            }
        }
    }

    #[cfg(feature = "postgres")]
    #[test]
    fn hostile_text_is_escaped_for_postgres() {
        let mut statement = Statement::new(Syntax::Postgres);
        statement.text("a'); DROP TABLE t; --\\\0");
        assert_eq!(
            statement.inline("", "").0,
            "E'a\\U00000027); DROP TABLE t; --\\U0000005c\\U00000000'"
        );
        let mut statement = Statement::new(Syntax::Postgres);
        statement
            .text("'")
            .bytes(&b""[..])
            .opt_int8(None)
            .sql(" WHERE k = ")
            .int8(1);
        assert_eq!(
            statement.inline("BEGIN; ", "; COMMIT").0,
            "BEGIN; E'\\U00000027', E'\\\\x', NULL WHERE k = 1; COMMIT"
        );
        assert_eq!(statement.bound().0.0, "$1, $2, $3 WHERE k = $4");
    }

    #[cfg(feature = "mysql")]
    #[test]
    fn hostile_text_is_written_as_hex_for_mysql() {
        let mut statement = Statement::new(Syntax::MySql);
        statement
            .text("a'); DROP TABLE t; --\\\0")
            .bytes(&b""[..])
            .opt_text(None::<&str>)
            .sql(" WHERE k = ")
            .int8(1);
        assert_eq!(
            statement.inline("", "").0,
            "_utf8mb4 X'6127293b2044524f50205441424c4520743b202d2d5c00', X'', NULL WHERE k = 1"
        );
        assert_eq!(statement.bound().0.0, "?, ?, ? WHERE k = ?");
    }
}
