"""Where a user's notices go (remote_notify.addresses) and what a mail carries: pure."""
from gpuguard.backends.remote_notify import addresses, mail_text
from gpuguard.config import NotifyConfig


def test_templates_name_the_user_and_a_users_own_entry_wins():
    settings = NotifyConfig(webhook="https://chat/hooks/{user}", mail="{user}@lab.example",
                            users={"bob": {"webhook": "https://ntfy.lab/bob-gpu"}})
    assert addresses(settings, "alice") == {"webhook": "https://chat/hooks/alice", "mail": "alice@lab.example"}
    assert addresses(settings, "bob") == {"webhook": "https://ntfy.lab/bob-gpu", "mail": "bob@lab.example"}
    assert addresses(NotifyConfig(), "alice") == {}


def test_a_name_is_quoted_into_the_url():
    assert addresses(NotifyConfig(webhook="https://chat/{user}"), "a/b?c") == {"webhook": "https://chat/a%2Fb%3Fc"}


def test_a_mail_has_the_first_line_as_subject_and_everything_as_body():
    text = mail_text("bob@lab.example", "gpu1", "gpuguard: GPU 0 is yours\nexport CUDA_VISIBLE_DEVICES=GPU-1").decode()
    headers, body = text.split("\n\n", 1)
    assert "To: bob@lab.example" in headers and "Subject: gpuguard on gpu1: GPU 0 is yours" in headers
    assert "export CUDA_VISIBLE_DEVICES=GPU-1" in body and "export" not in headers
