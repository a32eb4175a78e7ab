'''The chat templates of the model families users bring, rendered as the GGUF carries them.

Each template below is the family's own text, as its Hugging Face repository ships it in
tokenizer_config.json and its GGUF carries it; most are copied from llama.cpp's
tests/test-chat-template.cpp and models/templates/ (the repository named beside each). Tiny GGUFs
carry them with the family's special tokens (renamed control tokens of the generated tokenizer), so
`run`, `chat` and the server's rendering are checked without the multi-gigabyte models.
'''

from __future__ import annotations

import os

import pytest

from specllm.backend import LlamaBackend, LoadOptions
from specllm.chat import ChatTemplate, encode_messages
from specllm.session import Engine
from tests.cli_helpers import specllm_here
from tests.fakes import Scripted
from tests.tiny_gguf import write_tiny_gguf

# meta-llama/Llama-2-7b-chat-hf: every user turn opens with bos_token
LLAMA2 = (
    "{% if messages[0]['role'] == 'system' %}{% set loop_messages = messages[1:] %}{% set system_message = messages[0]['content'] %}"
    "{% else %}{% set loop_messages = messages %}{% set system_message = false %}{% endif %}{% for message in loop_messages %}"
    "{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}"
    "{% if loop.index0 == 0 and system_message != false %}{% set content = '<<SYS>>\\n' + system_message + '\\n<</SYS>>\\n\\n' + message['content'] %}"
    "{% else %}{% set content = message['content'] %}{% endif %}{% if message['role'] == 'user' %}{{ bos_token + '[INST] ' + content.strip() + ' [/INST]' }}"
    "{% elif message['role'] == 'assistant' %}{{ ' '  + content.strip() + ' ' + eos_token }}{% endif %}{% endfor %}"
)
# meta-llama/Llama-3.2-1B-Instruct (strftime_now, tools, namespace-free trims)
LLAMA32 = """{{- bos_token }}
{%- if custom_tools is defined %}
    {%- set tools = custom_tools %}
{%- endif %}
{%- if not tools_in_user_message is defined %}
    {%- set tools_in_user_message = true %}
{%- endif %}
{%- if not date_string is defined %}
    {%- if strftime_now is defined %}
        {%- set date_string = strftime_now("%d %b %Y") %}
    {%- else %}
        {%- set date_string = "26 Jul 2024" %}
    {%- endif %}
{%- endif %}
{%- if not tools is defined %}
    {%- set tools = none %}
{%- endif %}

{#- This block extracts the system message, so we can slot it into the right place. #}
{%- if messages[0]['role'] == 'system' %}
    {%- set system_message = messages[0]['content']|trim %}
    {%- set messages = messages[1:] %}
{%- else %}
    {%- set system_message = "" %}
{%- endif %}

{#- System message #}
{{- "<|start_header_id|>system<|end_header_id|>\\n\\n" }}
{%- if tools is not none %}
    {{- "Environment: ipython\\n" }}
{%- endif %}
{{- "Cutting Knowledge Date: December 2023\\n" }}
{{- "Today Date: " + date_string + "\\n\\n" }}
{%- if tools is not none and not tools_in_user_message %}
    {{- "You have access to the following functions. To call a function, please respond with JSON for a function call." }}
    {{- 'Respond in the format {"name": function name, "parameters": dictionary of argument name and its value}.' }}
    {{- "Do not use variables.\\n\\n" }}
    {%- for t in tools %}
        {{- t | tojson(indent=4) }}
        {{- "\\n\\n" }}
    {%- endfor %}
{%- endif %}
{{- system_message }}
{{- "<|eot_id|>" }}

{#- Custom tools are passed in a user message with some extra guidance #}
{%- if tools_in_user_message and not tools is none %}
    {#- Extract the first user message so we can plug it in here #}
    {%- if messages | length != 0 %}
        {%- set first_user_message = messages[0]['content']|trim %}
        {%- set messages = messages[1:] %}
    {%- else %}
        {{- raise_exception("Cannot put tools in the first user message when there's no first user message!") }}
{%- endif %}
    {{- '<|start_header_id|>user<|end_header_id|>\\n\\n' -}}
    {{- "Given the following functions, please respond with a JSON for a function call " }}
    {{- "with its proper arguments that best answers the given prompt.\\n\\n" }}
    {{- 'Respond in the format {"name": function name, "parameters": dictionary of argument name and its value}.' }}
    {{- "Do not use variables.\\n\\n" }}
    {%- for t in tools %}
        {{- t | tojson(indent=4) }}
        {{- "\\n\\n" }}
    {%- endfor %}
    {{- first_user_message + "<|eot_id|>"}}
{%- endif %}

{%- for message in messages %}
    {%- if not (message.role == 'ipython' or message.role == 'tool' or 'tool_calls' in message) %}
        {{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n'+ message['content'] | trim + '<|eot_id|>' }}
    {%- elif 'tool_calls' in message %}
        {%- if not message.tool_calls|length == 1 %}
            {{- raise_exception("This model only supports single tool-calls at once!") }}
        {%- endif %}
        {%- set tool_call = message.tool_calls[0].function %}
        {{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' -}}
        {{- '{"name": "' + tool_call.name + '", ' }}
        {{- '"parameters": ' }}
        {{- tool_call.arguments | tojson }}
        {{- "}" }}
        {{- "<|eot_id|>" }}
    {%- elif message.role == "tool" or message.role == "ipython" %}
        {{- "<|start_header_id|>ipython<|end_header_id|>\\n\\n" }}
        {%- if message.content is mapping or message.content is iterable %}
            {{- message.content | tojson }}
        {%- else %}
            {{- message.content }}
        {%- endif %}
        {{- "<|eot_id|>" }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}
{%- endif %}
"""
# google/gemma-2-2b-it: no system role, it raises on one
GEMMA2 = (
    "{{ bos_token }}{% if messages[0]['role'] == 'system' %}{{ raise_exception('System role not supported') }}{% endif %}"
    "{% for message in messages %}{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}"
    "{% if (message['role'] == 'assistant') %}{% set role = 'model' %}{% else %}{% set role = message['role'] %}{% endif %}"
    "{{ '<start_of_turn>' + role + '\\n' + message['content'] | trim + '<end_of_turn>\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{'<start_of_turn>model\\n'}}{% endif %}"
)
# google/gemma-3-1b-it: merges the system prompt into the first user turn itself
GEMMA3 = """{{ bos_token }}
{%- if messages[0]['role'] == 'system' -%}
    {%- if messages[0]['content'] is string -%}
        {%- set first_user_prefix = messages[0]['content'] + '\\n\\n' -%}
    {%- else -%}
        {%- set first_user_prefix = messages[0]['content'][0]['text'] + '\\n\\n' -%}
    {%- endif -%}
    {%- set loop_messages = messages[1:] -%}
{%- else -%}
    {%- set first_user_prefix = "" -%}
    {%- set loop_messages = messages -%}
{%- endif -%}
{%- for message in loop_messages -%}
    {%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) -%}
        {{ raise_exception("Conversation roles must alternate user/assistant/user/assistant/...") }}
    {%- endif -%}
    {%- if (message['role'] == 'assistant') -%}
        {%- set role = "model" -%}
    {%- else -%}
        {%- set role = message['role'] -%}
    {%- endif -%}
    {{ '<start_of_turn>' + role + '\\n' + (first_user_prefix if loop.first else "") }}
    {%- if message['content'] is string -%}
        {{ message['content'] | trim }}
    {%- elif message['content'] is iterable -%}
        {%- for item in message['content'] -%}
            {%- if item['type'] == 'image' -%}
                {{ '<start_of_image>' }}
            {%- elif item['type'] == 'text' -%}
                {{ item['text'] | trim }}
            {%- endif -%}
        {%- endfor -%}
    {%- else -%}
        {{ raise_exception("Invalid content type") }}
    {%- endif -%}
    {{ '<end_of_turn>\\n' }}
{%- endfor -%}
{%- if add_generation_prompt -%}
    {{'<start_of_turn>model\\n'}}
{%- endif -%}
"""
# mistralai/Mistral-7B-Instruct-v0.2 (first release): user and assistant roles only
MISTRAL_V02 = (
    "{{ bos_token }}{% for message in messages %}{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}"
    "{% if message['role'] == 'user' %}{{ '[INST] ' + message['content'] + ' [/INST]' }}{% elif message['role'] == 'assistant' %}"
    "{{ message['content'] + eos_token}}{% else %}{{ raise_exception('Only user and assistant roles are supported!') }}{% endif %}{% endfor %}"
)
# mistralai/Mistral-Nemo-Instruct-2407 (llama.cpp's test-chat-template.cpp): the system prompt goes
# into the last user turn, the roles strictly alternate, tool calls and results in its own tags
MISTRAL_NEMO = """{%- if messages[0]["role"] == "system" %}
    {%- set system_message = messages[0]["content"] %}
    {%- set loop_messages = messages[1:] %}
{%- else %}
    {%- set loop_messages = messages %}
{%- endif %}
{%- if not tools is defined %}
    {%- set tools = none %}
{%- endif %}
{%- set user_messages = loop_messages | selectattr("role", "equalto", "user") | list %}

{#- This block checks for alternating user/assistant messages, skipping tool calling messages #}
{%- set ns = namespace() %}
{%- set ns.index = 0 %}
{%- for message in loop_messages %}
    {%- if not (message.role == "tool" or message.role == "tool_results" or (message.tool_calls is defined and message.tool_calls is not none)) %}
        {%- if (message["role"] == "user") != (ns.index % 2 == 0) %}
            {{- raise_exception("After the optional system message, conversation roles must alternate user/assistant/user/assistant/...") }}
        {%- endif %}
        {%- set ns.index = ns.index + 1 %}
    {%- endif %}
{%- endfor %}

{{- bos_token }}
{%- for message in loop_messages %}
    {%- if message["role"] == "user" %}
        {%- if tools is not none and (message == user_messages[-1]) %}
            {{- "[AVAILABLE_TOOLS][" }}
            {%- for tool in tools %}
                {%- set tool = tool.function %}
                {{- '{"type": "function", "function": {' }}
                {%- for key, val in tool.items() if key != "return" %}
                    {%- if val is string %}
                        {{- '"' + key + '": "' + val + '"' }}
                    {%- else %}
                        {{- '"' + key + '": ' + val|tojson }}
                    {%- endif %}
                    {%- if not loop.last %}
                        {{- ", " }}
                    {%- endif %}
                {%- endfor %}
                {{- "}}" }}
                {%- if not loop.last %}
                    {{- ", " }}
                {%- else %}
                    {{- "]" }}
                {%- endif %}
            {%- endfor %}
            {{- "[/AVAILABLE_TOOLS]" }}
            {%- endif %}
        {%- if loop.last and system_message is defined %}
            {{- "[INST]" + system_message + "\\n\\n" + message["content"] + "[/INST]" }}
        {%- else %}
            {{- "[INST]" + message["content"] + "[/INST]" }}
        {%- endif %}
    {%- elif (message.tool_calls is defined and message.tool_calls is not none) %}
        {{- "[TOOL_CALLS][" }}
        {%- for tool_call in message.tool_calls %}
            {%- set out = tool_call.function|tojson %}
            {{- out[:-1] }}
            {%- if not tool_call.id is defined or tool_call.id|length != 9 %}
                {{- raise_exception("Tool call IDs should be alphanumeric strings with length 9!") }}
            {%- endif %}
            {{- ', "id": "' + tool_call.id + '"}' }}
            {%- if not loop.last %}
                {{- ", " }}
            {%- else %}
                {{- "]" + eos_token }}
            {%- endif %}
        {%- endfor %}
    {%- elif message["role"] == "assistant" %}
        {{- message["content"] + eos_token}}
    {%- elif message["role"] == "tool_results" or message["role"] == "tool" %}
        {%- if message.content is defined and message.content.content is defined %}
            {%- set content = message.content.content %}
        {%- else %}
            {%- set content = message.content %}
        {%- endif %}
        {{- '[TOOL_RESULTS]{"content": ' + content|string + ", " }}
        {%- if not message.tool_call_id is defined or message.tool_call_id|length != 9 %}
            {{- raise_exception("Tool call IDs should be alphanumeric strings with length 9!") }}
        {%- endif %}
        {{- '"call_id": "' + message.tool_call_id + '"}[/TOOL_RESULTS]' }}
    {%- else %}
        {{- raise_exception("Only user and assistant roles are supported, with the exception of an initial optional system message!") }}
    {%- endif %}
{%- endfor %}
"""
# microsoft/Phi-3-mini-4k-instruct (first release), Phi-3-medium: a system message is left out
PHI3_MINI = (
    "{{ bos_token }}{% for message in messages %}{% if (message['role'] == 'user') %}"
    "{{'<|user|>' + '\\n' + message['content'] + '<|end|>' + '\\n' + '<|assistant|>' + '\\n'}}"
    "{% elif (message['role'] == 'assistant') %}{{message['content'] + '<|end|>' + '\\n'}}{% endif %}{% endfor %}"
)
# microsoft/phi-4
PHI4 = (
    "{% for message in messages %}{% if (message['role'] == 'system') %}{{'<|im_start|>system<|im_sep|>' + message['content'] + '<|im_end|>'}}"
    "{% elif (message['role'] == 'user') %}{{'<|im_start|>user<|im_sep|>' + message['content'] + '<|im_end|><|im_start|>assistant<|im_sep|>'}}"
    "{% elif (message['role'] == 'assistant') %}{{message['content'] + '<|im_end|>'}}{% endif %}{% endfor %}"
)
# deepseek-ai/DeepSeek-R1-Distill-Qwen-32B (llama.cpp's models/templates/): earlier answers' reasoning
# dropped, every answer opens a thinking block
R1_DISTILL = (
    "{% if not add_generation_prompt is defined -%}\n  {%- set add_generation_prompt = false -%}\n{%- endif -%}\n"
    "{%- set ns = namespace(is_first=false, is_tool=false, is_output_first=true, system_prompt='') -%}\n"
    "{%- for message in messages -%}\n  {%- if message['role'] == 'system' -%}\n    {%- set ns.system_prompt = message['content'] -%}\n"
    "  {%- endif -%}\n{%- endfor -%}{{bos_token}}{{ns.system_prompt}}\n{%- for message in messages -%}\n"
    "  {%- if message['role'] == 'user' -%}\n    {%- set ns.is_tool = false -%}{{'<｜User｜>' + message['content']}}\n  {%- endif -%}\n"
    "  {%- if message['role'] == 'assistant' and message['tool_calls'] -%}\n    {%- set ns.is_tool = false -%}\n"
    "    {%- for tool in message['tool_calls']-%}\n      {%- if not ns.is_first -%}\n"
    "        {{'<｜Assistant｜><｜tool▁calls▁begin｜><｜tool▁call▁begin｜>' + tool['type'] + '<｜tool▁sep｜>' + tool['function']['name'] + '\\n' + '```json' + '\\n' + tool['function']['arguments'] + '\\n' + '```' + '<｜tool▁call▁end｜>'}}\n"
    "        {%- set ns.is_first = true -%}\n      {%- else -%}\n"
    "        {{'\\n' + '<｜tool▁call▁begin｜>' + tool['type'] + '<｜tool▁sep｜>' + tool['function']['name'] + '\\n' + '```json' + '\\n' + tool['function']['arguments'] + '\\n' + '```' + '<｜tool▁call▁end｜>'}}\n"
    "      {%- endif -%}\n    {%- endfor -%}\n    {{'<｜tool▁calls▁end｜><｜end▁of▁sentence｜>'}}\n  {%- endif -%}\n"
    "  {%- if message['role'] == 'assistant' and message['content'] is not none -%}\n"
    "    {%- if ns.is_tool -%}{{'<｜tool▁outputs▁end｜>' + message['content'] + '<｜end▁of▁sentence｜>'}}\n      {%- set ns.is_tool = false -%}\n"
    "    {%- else -%}\n      {%- set content = message['content'] -%}\n      {%- if '</think>' in content -%}\n"
    "        {%- set content = content.split('</think>')[-1] -%}\n      {%- endif -%}{{'<｜Assistant｜>' + content + '<｜end▁of▁sentence｜>'}}\n"
    "    {%- endif -%}\n  {%- endif -%}\n  {%- if message['role'] == 'tool' -%}\n    {%- set ns.is_tool = true -%}\n"
    "    {%- if ns.is_output_first -%}{{'<｜tool▁outputs▁begin｜><｜tool▁output▁begin｜>' + message['content'] + '<｜tool▁output▁end｜>'}}\n"
    "      {%- set ns.is_output_first = false -%}\n      {%- else -%}{{'\\n<｜tool▁output▁begin｜>' + message['content'] + '<｜tool▁output▁end｜>'}}\n"
    "    {%- endif -%}\n  {%- endif -%}\n{%- endfor -%}\n{%- if ns.is_tool -%}{{'<｜tool▁outputs▁end｜>'}}\n{%- endif -%}\n"
    "{%- if add_generation_prompt and not ns.is_tool -%}{{'<｜Assistant｜><think>\\n'}}\n{%- endif %}"
)
# ibm-granite/granite-3.0-8b-instruct
GRANITE3 = (
    "{%- if tools %}\n    {{- '<|start_of_role|>available_tools<|end_of_role|>\n' }}\n    {%- for tool in tools %}\n    {{- tool | tojson(indent=4) }}\n"
    "    {%- if not loop.last %}\n        {{- '\n\n' }}\n    {%- endif %}\n    {%- endfor %}\n    {{- '<|end_of_text|>\n' }}\n{%- endif %}\n"
    "{%- for message in messages %}\n    {%- if message['role'] == 'system' %}\n    {{- '<|start_of_role|>system<|end_of_role|>' + message['content'] + '<|end_of_text|>\n' }}\n"
    "    {%- elif message['role'] == 'user' %}\n    {{- '<|start_of_role|>user<|end_of_role|>' + message['content'] + '<|end_of_text|>\n' }}\n"
    "    {%- elif message['role'] == 'assistant' %}\n    {{- '<|start_of_role|>assistant<|end_of_role|>'  + message['content'] + '<|end_of_text|>\n' }}\n"
    "    {%- elif message['role'] == 'assistant_tool_call' %}\n    {{- '<|start_of_role|>assistant<|end_of_role|><|tool_call|>' + message['content'] + '<|end_of_text|>\n' }}\n"
    "    {%- elif message['role'] == 'tool_response' %}\n    {{- '<|start_of_role|>tool_response<|end_of_role|>' + message['content'] + '<|end_of_text|>\n' }}\n"
    "    {%- endif %}\n    {%- if loop.last and add_generation_prompt %}\n    {{- '<|start_of_role|>assistant<|end_of_role|>' }}\n    {%- endif %}\n{%- endfor %}"
)
# CohereForAI/c4ai-command-r-plus
COMMAND_R = (
    "{{ bos_token }}{% if messages[0]['role'] == 'system' %}{% set loop_messages = messages[1:] %}{% set system_message = messages[0]['content'] %}"
    "{% elif false == true %}{% set loop_messages = messages %}{% set system_message = 'You are Command-R, a brilliant, sophisticated, AI-assistant trained to assist human users by providing thorough responses. You are trained by Cohere.' %}"
    "{% else %}{% set loop_messages = messages %}{% set system_message = false %}{% endif %}{% if system_message != false %}"
    "{{ '<|START_OF_TURN_TOKEN|><|SYSTEM_TOKEN|>' + system_message + '<|END_OF_TURN_TOKEN|>' }}{% endif %}{% for message in loop_messages %}"
    "{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}"
    "{% set content = message['content'] %}{% if message['role'] == 'user' %}{{ '<|START_OF_TURN_TOKEN|><|USER_TOKEN|>' + content.strip() + '<|END_OF_TURN_TOKEN|>' }}"
    "{% elif message['role'] == 'assistant' %}{{ '<|START_OF_TURN_TOKEN|><|CHATBOT_TOKEN|>'  + content.strip() + '<|END_OF_TURN_TOKEN|>' }}{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|START_OF_TURN_TOKEN|><|CHATBOT_TOKEN|>' }}{% endif %}"
)
# ByteDance-Seed/Seed-OSS-36B-Instruct (llama.cpp's test-chat-template.cpp): bos_token opens every turn
SEED_OSS = (
    '{# <seed:bos> #}{%- for message in messages %}{%- if message.role in ["user", "system"] %}{{ bos_token + message.role + "\\n" + message.content + eos_token }}'
    '{%- elif message.role == "assistant" %}{{ bos_token + message.role }}{%- if message.content is defined and message.content is string and message.content|trim|length > 0 %}'
    '{{ "\\n" + message.content|trim + eos_token }}{%- endif %}{%- else %}{{ bos_token + message.role + "\\n" + message.content + eos_token }}{%- endif %}{%- endfor %}'
    '{%- if add_generation_prompt %}{{ bos_token + "assistant\\n" }}{%- endif %}'
)
# yandex/YandexGPT-5-Lite-8B-instruct (llama.cpp's test-chat-template.cpp), shortened to its opening:
# the BOS written as text, not through bos_token
LITERAL_BOS = "<s>{% for message in messages %}{{ ' ' + message.role + ': ' + message.content + '\\n\\n' }}{% endfor %}{{ ' assistant:[SEP]' }}"

# Each family's special tokens, as control tokens of the generated tokenizer (ids 1 and 2 are its BOS and EOS)
LLAMA_TOKENS = {1: "<s>", 2: "</s>"}
FAMILIES = {  # name: (template, token renames, BOS added by the tokenizer)
    "llama2": (LLAMA2, {**LLAMA_TOKENS, 3: "[INST]", 4: "[/INST]"}, True),
    "llama3.2": (LLAMA32, {1: "<|begin_of_text|>", 2: "<|eot_id|>", 3: "<|start_header_id|>", 4: "<|end_header_id|>"}, True),
    "gemma2": (GEMMA2, {1: "<bos>", 2: "<eos>", 3: "<start_of_turn>", 4: "<end_of_turn>"}, True),
    "gemma3": (GEMMA3, {1: "<bos>", 2: "<eos>", 3: "<start_of_turn>", 4: "<end_of_turn>"}, True),
    "mistral-v0.2": (MISTRAL_V02, {**LLAMA_TOKENS, 3: "[INST]", 4: "[/INST]"}, True),
    "mistral-nemo": (MISTRAL_NEMO, {**LLAMA_TOKENS, 3: "[INST]", 4: "[/INST]"}, True),
    "phi3-mini": (PHI3_MINI, {**LLAMA_TOKENS, 3: "<|user|>", 4: "<|assistant|>", 5: "<|end|>"}, True),
    "phi4": (PHI4, {3: "<|im_sep|>"}, False),
    "r1-distill": (R1_DISTILL, {1: "<｜begin▁of▁sentence｜>", 2: "<｜end▁of▁sentence｜>", 3: "<｜User｜>", 4: "<｜Assistant｜>"}, True),
    "granite3": (GRANITE3, {2: "<|end_of_text|>", 3: "<|start_of_role|>", 4: "<|end_of_role|>"}, False),
    "command-r": (COMMAND_R, {1: "<BOS_TOKEN>", 2: "<|END_OF_TURN_TOKEN|>", 3: "<|START_OF_TURN_TOKEN|>", 4: "<|USER_TOKEN|>", 5: "<|CHATBOT_TOKEN|>", 6: "<|SYSTEM_TOKEN|>"}, True),
    "seed-oss": (SEED_OSS, {1: "<seed:bos>", 2: "<seed:eos>"}, False),
}

CONVERSATION = [
    {"role": "system", "content": "Answer in French."},
    {"role": "user", "content": "Hello"},
    {"role": "assistant", "content": "Bonjour"},
    {"role": "user", "content": "Who are you?"},
]


@pytest.fixture(scope="module")
def family(tmp_path_factory):
    """A tiny model carrying a family's template and special tokens, loaded once per family."""
    folder, loaded = tmp_path_factory.mktemp("families"), {}

    def load(name: str) -> LlamaBackend:
        if name not in loaded:
            template, tokens, add_bos = FAMILIES[name]
            path = write_tiny_gguf(folder / f"{name}.gguf", 0, n_layers=1, chat_template=template, token_edits=tokens,
                                   tokenizer_scalars={"tokenizer.ggml.add_bos_token": add_bos})  # fmt: skip
            loaded[name] = LlamaBackend(path, LoadOptions(n_ctx=512, n_threads=1))
        return loaded[name]

    yield load
    for model in loaded.values():
        model.close()


def as_text(model, tokens: list[int]) -> str:
    """The prompt as the model reads it, special tokens written out."""
    return b"".join(model.token_bytes(t) or model.token_text(t).encode() for t in tokens).decode()


# -- every family's template renders ----------------------------------------------------------------


@pytest.mark.parametrize("name", FAMILIES)
def test_every_familys_template_renders_a_conversation_with_every_word_of_it(family, name):
    """A conversation with a system prompt reaches the model whole through the family's own template
    (Jinja's loop controls, namespace, raise_exception, strftime_now): no message lost, the first
    token BOS once where the tokenizer adds it."""
    model = family(name)
    tokens = encode_messages(model, CONVERSATION)
    text = as_text(model, tokens)
    for message in CONVERSATION:
        assert message["content"] in text, (name, text)
    bos = model.tokenize("", add_special=True)
    if bos:
        assert tokens[0] == bos[0] and tokens[1] != bos[0]


# -- a template without a system role ---------------------------------------------------------------


@pytest.mark.parametrize("template", [GEMMA2, PHI3_MINI, MISTRAL_V02], ids=["gemma2 raises", "phi3 leaves it out", "mistral-v0.2 raises"])
def test_a_template_without_a_system_role_gets_the_system_prompt_in_the_first_user_turn(template):
    chat = ChatTemplate(template, "</s>")
    rendered = chat.render(CONVERSATION)
    assert rendered == chat.render([{**CONVERSATION[1], "content": "Answer in French.\n\nHello"}, *CONVERSATION[2:]])
    # --system '' is no system prompt at all; a system prompt alone (the chat's count of its tokens) is there
    assert chat.render([{"role": "system", "content": ""}, *CONVERSATION[1:]]) == chat.render(CONVERSATION[1:])
    assert "Answer in French." in chat.render(CONVERSATION[:1], add_generation_prompt=False)


def test_a_template_with_a_system_role_is_rendered_as_it_writes_it():
    """Mistral Nemo's puts the system prompt in the last user turn, Llama 2's in <<SYS>>: left there."""
    for template in (MISTRAL_NEMO, LLAMA2, GRANITE3, COMMAND_R, PHI4):
        chat = ChatTemplate(template, "</s>")
        assert chat.takes_system and "Answer in French.\n\nHello" not in chat.render(CONVERSATION)


def test_run_and_chat_send_the_system_prompt_to_a_model_whose_template_has_no_system_role(tmp_path, monkeypatch):
    decoder = Scripted(["Bonjour"])
    monkeypatch.setattr(Engine, "decoder", lambda self, strategy=None: decoder)
    _, tokens, _ = FAMILIES["phi3-mini"]
    path = write_tiny_gguf(tmp_path / "phi3.gguf", 0, n_layers=1, chat_template=PHI3_MINI, token_edits=tokens)
    env = dict(os.environ)
    for command, stdin in (("run", b""), ("chat", b"Hello\n")):
        args = ("-p", "Hello") if command == "run" else ()
        done = specllm_here(env, command, "-m", path, "--spec", "off", "--system", "Answer in French.", *args, stdin=stdin)
        assert (done.returncode, done.stdout) == (0, "Bonjour\n"), done.stderr
    model = LlamaBackend(path, LoadOptions(n_ctx=256, n_threads=1))
    try:
        for prompt in decoder.prompts:
            assert b"".join(model.token_bytes(t) for t in prompt).decode() == "\nAnswer in French.\n\nHello\n\n"  # control tokens read as nothing
    finally:
        model.close()


# -- BOS --------------------------------------------------------------------------------------------


def test_a_template_that_opens_every_turn_with_bos_keeps_each_and_the_first_once(family):
    """Llama 2's template opens each user turn with BOS (`bos_token`): the later turns keep theirs,
    the first is the tokenizer's, once (as Transformers' and llama.cpp's prompts read)."""
    model = family("llama2")
    bos = model.tokenize("", add_special=True)[0]
    tokens = encode_messages(model, CONVERSATION)
    assert tokens[0] == bos and tokens[1] != bos
    assert tokens.count(bos) == 2
    assert as_text(model, tokens).startswith("<s>[INST] <<SYS>>\nAnswer in French.\n<</SYS>>\n\nHello [/INST] Bonjour </s><s>[INST] Who are you? [/INST]")


def test_a_template_whose_bos_marks_every_turn_writes_each(family):
    """Seed-OSS's template writes `bos_token` before every role (its tokenizer adds none)."""
    model = family("seed-oss")
    text = as_text(model, encode_messages(model, CONVERSATION))
    assert text == ("<seed:bos>system\nAnswer in French.<seed:eos><seed:bos>user\nHello<seed:eos><seed:bos>assistant\nBonjour<seed:eos>"
                    "<seed:bos>user\nWho are you?<seed:eos><seed:bos>assistant\n")  # fmt: skip


def test_a_bos_written_as_text_at_the_start_is_not_doubled(tmp_path):
    path = write_tiny_gguf(tmp_path / "literal.gguf", 0, n_layers=1, chat_template=LITERAL_BOS, token_edits=LLAMA_TOKENS,
                           tokenizer_scalars={"tokenizer.ggml.add_bos_token": True})  # fmt: skip
    model = LlamaBackend(path, LoadOptions(n_ctx=256, n_threads=1))
    try:
        bos = model.tokenize("", add_special=True)
        tokens = encode_messages(model, CONVERSATION[1:2])
        assert bos and tokens[0] == bos[0] and tokens.count(bos[0]) == 1
    finally:
        model.close()


# -- the end of a turn and earlier reasoning ----------------------------------------------------------


@pytest.mark.parametrize("name", ["llama3.2", "gemma2", "phi3-mini", "r1-distill", "granite3"])
def test_generation_ends_at_the_familys_end_of_turn_token_whatever_the_eos(family, name):
    """The token that closes an assistant turn in the family's template ends generation, also where
    the GGUF's EOS is another token (Gemma's <eos>, Phi-3's </s>): llama.cpp marks it, by its text."""
    model = family(name)
    closing = {"llama3.2": "<|eot_id|>", "gemma2": "<end_of_turn>", "phi3-mini": "<|end|>", "r1-distill": "<｜end▁of▁sentence｜>", "granite3": "<|end_of_text|>"}[name]
    (token,) = model.tokenize(closing, parse_special=True)
    assert model.is_eog(token)


def test_r1s_template_reads_earlier_answers_without_their_reasoning(family):
    model = family("r1-distill")
    thought = [{**m, "content": "<think>\nFrench.\n</think>\n\nBonjour"} if m["role"] == "assistant" else m for m in CONVERSATION]
    assert encode_messages(model, thought) == encode_messages(model, CONVERSATION)
    assert as_text(model, encode_messages(model, CONVERSATION)).endswith("<｜Assistant｜><think>\n")


EXPECTED = {  # what reaches the model, control tokens read as nothing
    "gemma2": ("user\nAnswer in French.\n\nHello\nmodel\nBonjour\nuser\nWho are you?\nmodel\n",
               "user\nHello\nmodel\nBonjour\nuser\nBe brief.\n\nWho are you?\nmodel\n"),
    "phi3-mini": ("\nAnswer in French.\n\nHello\n\nBonjour\n\nWho are you?\n\n", "\nHello\n\nBonjour\n\nBe brief.\n\nWho are you?\n\n"),
}  # fmt: skip


@pytest.mark.parametrize("name", EXPECTED)
def test_the_server_sends_system_messages_to_a_model_whose_template_has_no_system_role(name, tmp_path):
    """/v1/chat/completions: a system message (first, or between turns, as agents send them) opens
    the user turn after it, for Gemma 2's template (which raises on one) and Phi-3 mini's (which
    leaves it out)."""
    from specllm.server.app import Service
    from specllm.session import ModelPaths, SpecConfig
    from tests.server_helpers import TINY, client, running

    template, tokens, _ = FAMILIES[name]
    path = write_tiny_gguf(tmp_path / f"{name}.gguf", 0, n_layers=1, chat_template=template, token_edits=tokens)
    engine, decoder = Engine(ModelPaths(path), SpecConfig("off"), TINY, TINY), Scripted(["Bonjour"])
    try:
        with running(Service(engine, "tiny", make_decoder=lambda: decoder)) as url:
            api = client(url)
            answer = api.chat.completions.create(model="tiny", messages=CONVERSATION)
            later = [*CONVERSATION[1:3], {"role": "system", "content": "Be brief."}, CONVERSATION[3]]
            api.chat.completions.create(model="tiny", messages=later)
        assert answer.choices[0].message.content == "Bonjour"
        first, second = (b"".join(engine.target.token_bytes(t) for t in prompt).decode() for prompt in decoder.prompts)
        assert (first, second) == EXPECTED[name]
    finally:
        engine.close()
